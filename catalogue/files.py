"""Catalogue files: the shipped catalogue/data.json and the user's own JSON or TOML, one schema.

A user file adds entries or replaces shipped ones by name (case-insensitive), so a team can
record the instance types it rents, its negotiated prices or figures it measured, without
editing stagewise. Every figure names its sources by id; a user file may cite the shipped
sources' ids as well as its own. A mistake is a DeviceError naming the file, the entry and the
field, so a typo in a 200-line file is found at once. The schema, with TOML as the example:

    schema_version = 1                       # optional; 1 is the only version
    [sources.our-bench]
    url = "https://wiki.example.com/gpu-bench"
    title = "Our matmul benchmark"
    accessed = 2026-11-20                    # the day read or measured; `published` optional
    kind = "measured"                        # vendor | third_party | measured

    [accelerators.MY-GPU]
    kind = "cuda"                            # cuda | cpu
    aliases = ["MYGPU"]
    memory = { value = "48GB", sources = ["our-bench"] }
    memory_bandwidth = { value = "864GB/s", sources = ["our-bench"] }
    host_bandwidth = { value = "32GB/s", sources = ["our-bench"], note = "PCIe 4.0 x16, one way" }
    peak_flops.bf16 = { value = "181TFLOPS", sources = ["our-bench"] }    # fp32 | tf32 | bf16 | fp16

    [instance_types."box.8gpu"]
    provider = "onprem"
    accelerator = "MY-GPU"
    accelerators = 8
    inter_node_bandwidth = { value = "25GB/s", sources = ["our-bench"] }
    host_memory = { value = "1TiB", sources = ["our-bench"] }      # the instance's RAM, its devices share
    on_demand = { usd_per_hour = 12.5, region = "dc1", sources = ["our-bench"] }
"""

from __future__ import annotations

import functools
import json
import math
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import date, datetime
from importlib import resources
from os import PathLike
from pathlib import Path
from typing import Any, TypeVar

from stagewise.catalogue.entries import (
    Accelerator,
    AcceleratorKind,
    Catalogue,
    Dtype,
    Figure,
    InstanceType,
    PeakFlops,
    Price,
    Source,
    SourceKind,
)
from stagewise.ir.devices import parse_bandwidth, parse_bytes, parse_flops
from stagewise.ir.errors import DeviceError

SCHEMA_VERSION = 1
SHIPPED_DATA = "data.json"

_Parse = Callable[[Any], float | None]
_Choice = TypeVar("_Choice", Dtype, AcceleratorKind, SourceKind)


@dataclass(frozen=True)
class _Entries:
    """One file's contents, keyed by case-folded name, before they join a Catalogue (an instance
    type in a user file may hold a shipped accelerator, so references are checked after merging)."""

    sources: dict[str, Source]
    accelerators: dict[str, Accelerator]
    instance_types: dict[str, InstanceType]


@functools.cache
def _shipped_entries() -> _Entries:
    text = resources.files("stagewise.catalogue").joinpath(SHIPPED_DATA).read_text(encoding="utf-8")
    return _entries(json.loads(text), "the shipped catalogue (stagewise/catalogue/data.json)", {})


@functools.cache
def shipped_catalogue() -> Catalogue:
    """The catalogue stagewise ships: public datasheet figures and list prices, each with its source."""
    return _catalogue(_shipped_entries(), "the shipped catalogue")


def load_catalogue(path: str | PathLike[str] | None = None) -> Catalogue:
    r"""The shipped catalogue with the entries of a JSON or TOML file merged over it (an entry
    whose name the shipped catalogue has replaces it whole): a team's own machines, prices or
    measured figures, in the schema this module's docstring shows.

    Args:
        path: a .json or .toml file; None gives the shipped catalogue alone.

    Returns:
        The merged `Catalogue`.

    Raises:
        DeviceError: the file cannot be read or parsed, or an entry breaks the schema; the message
            names the file, the entry and the field.

    Example:
        >>> (tmp / "my.toml").write_text("\n".join([
        ...     '[sources.bench]', 'url = "https://example.com/bench"', 'title = "Our benchmark"',
        ...     'accessed = 2026-11-20', 'kind = "measured"',
        ...     '[accelerators.MY-GPU]', 'kind = "cuda"', 'memory = { value = "48GB", sources = ["bench"] }',
        ...     'memory_bandwidth = { value = "864GB/s", sources = ["bench"] }',
        ...     'host_bandwidth = { value = "32GB/s", sources = ["bench"] }',
        ...     'peak_flops.bf16 = { value = "181TFLOPS", sources = ["bench"] }'])) > 0
        True
        >>> catalogue = sw.load_catalogue(tmp / "my.toml")
        >>> catalogue.accelerator("my-gpu").memory.value, catalogue.knows_accelerator("H100")
        (48000000000.0, True)
    """
    if path is None:
        return shipped_catalogue()
    shipped = _shipped_entries()
    origin = f"catalogue file {path}"
    user = _entries(_read(Path(path), origin), origin, shipped.sources)
    merged = _Entries(sources={**shipped.sources, **user.sources},
                      accelerators={**shipped.accelerators, **user.accelerators},
                      instance_types={**shipped.instance_types, **user.instance_types})
    return _catalogue(merged, origin)


def _catalogue(entries: _Entries, origin: str) -> Catalogue:
    try:
        return Catalogue(tuple(entries.accelerators.values()), tuple(entries.instance_types.values()))
    except DeviceError as err:
        raise DeviceError(f"{origin}: {err}") from None


def _read(path: Path, origin: str) -> Mapping[str, object]:
    """The file's top-level table; JSON or TOML by its suffix."""
    if path.suffix.lower() not in (".json", ".toml"):
        raise DeviceError(f"{origin}: a catalogue file is .json or .toml, not {path.suffix or 'suffixless'}")
    try:
        if path.suffix.lower() == ".toml":
            with path.open("rb") as file:
                return tomllib.load(file)
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise DeviceError(f"{origin}: no such file; give the path of a .json or .toml catalogue") from None
    except (tomllib.TOMLDecodeError, json.JSONDecodeError, UnicodeDecodeError) as err:
        raise DeviceError(f"{origin}: not valid {path.suffix[1:].upper()} ({err})") from None
    return _table(data, origin)


def _entries(data: Mapping[str, object], origin: str, known_sources: Mapping[str, Source]) -> _Entries:
    _check_fields(data, origin, required=set(),
                  optional={"schema_version", "sources", "accelerators", "instance_types"})
    version = data.get("schema_version", SCHEMA_VERSION)
    if version != SCHEMA_VERSION:
        raise DeviceError(f"{origin}: schema_version {version!r} is not one this stagewise reads "
                          f"({SCHEMA_VERSION}); write schema_version = {SCHEMA_VERSION}")
    own = {name: _source(_table(table, f"{origin}, sources.{name}"), f"{origin}, sources.{name}")
           for name, table in _table(data.get("sources", {}), f"{origin}, sources").items()}
    sources = {**known_sources, **own}
    accelerators = _named(data, "accelerators", origin, lambda name, where, table:
                          _accelerator(name, table, where, sources))
    instances = _named(data, "instance_types", origin, lambda name, where, table:
                       _instance_type(name, table, where, sources))
    return _Entries(own, accelerators, instances)


def _named(data: Mapping[str, object], section: str, origin: str, build: Callable) -> dict:
    """`build(name, where, table)` for every entry of a section, keyed by case-folded name."""
    built = {}
    for name, table in _table(data.get(section, {}), f"{origin}, {section}").items():
        where = f"{origin}, {section}.{name!r}"
        if name.casefold() in built:
            raise DeviceError(f"{where}: {name!r} is defined twice (names ignore case); keep one")
        built[name.casefold()] = build(name, where, _table(table, where))
    return built


def _source(table: Mapping[str, object], where: str) -> Source:
    _check_fields(table, where, required={"url", "title", "accessed", "kind"}, optional={"published"})
    published = table.get("published")
    return Source(url=_text(table["url"], f"{where}.url"), title=_text(table["title"], f"{where}.title"),
                  accessed=_date(table["accessed"], f"{where}.accessed"),
                  kind=_choice(table["kind"], SourceKind, f"{where}.kind"),
                  published=None if published is None else _date(published, f"{where}.published"))


def _accelerator(name: str, table: Mapping[str, object], where: str,
                 sources: Mapping[str, Source]) -> Accelerator:
    _check_fields(table, where, required={"kind"},
                  optional={"aliases", "memory", "peak_flops", "memory_bandwidth", "host_bandwidth", "note"})
    aliases = table.get("aliases", [])
    if not isinstance(aliases, list):
        raise DeviceError(f"{where}.aliases: give a list of names, e.g. aliases = [\"H100\"]")
    flops = _table(table.get("peak_flops", {}), f"{where}.peak_flops")
    _check_fields(flops, f"{where}.peak_flops", required=set(), optional={d.value for d in Dtype})
    return Accelerator(
        name=name, kind=_choice(table["kind"], AcceleratorKind, f"{where}.kind"),
        aliases=tuple(_text(alias, f"{where}.aliases") for alias in aliases),
        memory=_figure(table.get("memory"), f"{where}.memory", parse_bytes, sources),
        peak_flops=PeakFlops(**{d: _figure(flops.get(d), f"{where}.peak_flops.{d}", parse_flops, sources)
                                for d in flops}),
        memory_bandwidth=_figure(table.get("memory_bandwidth"), f"{where}.memory_bandwidth",
                                 _bandwidth("memory_bandwidth"), sources),
        host_bandwidth=_figure(table.get("host_bandwidth"), f"{where}.host_bandwidth",
                               _bandwidth("host_bandwidth"), sources),
        note=_note(table, where))


def _instance_type(name: str, table: Mapping[str, object], where: str,
                   sources: Mapping[str, Source]) -> InstanceType:
    _check_fields(table, where, required={"provider", "accelerator", "accelerators"},
                  optional={"intra_node_bandwidth", "inter_node_bandwidth", "host_memory", "on_demand", "spot", "note"})
    count = table["accelerators"]
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise DeviceError(f"{where}.accelerators: {count!r} is not a positive whole number of accelerators "
                          "per instance, e.g. accelerators = 8")
    return InstanceType(
        name=name, provider=_text(table["provider"], f"{where}.provider"),
        accelerator=_text(table["accelerator"], f"{where}.accelerator"), accelerators=count,
        intra_node_bandwidth=_figure(table.get("intra_node_bandwidth"), f"{where}.intra_node_bandwidth",
                                     _bandwidth("intra_node_bandwidth"), sources),
        inter_node_bandwidth=_figure(table.get("inter_node_bandwidth"), f"{where}.inter_node_bandwidth",
                                     _bandwidth("inter_node_bandwidth"), sources),
        on_demand=_price(table.get("on_demand"), f"{where}.on_demand", sources),
        spot=_price(table.get("spot"), f"{where}.spot", sources),
        note=_note(table, where),
        host_memory=_figure(table.get("host_memory"), f"{where}.host_memory",
                            functools.partial(parse_bytes, what="host_memory"), sources))


def _figure(value: object, where: str, parse: _Parse, sources: Mapping[str, Source]) -> Figure | None:
    """A {value, sources, note} table (None where the entry leaves the figure out)."""
    if value is None:
        return None
    table = _table(value, where)
    _check_fields(table, where, required={"value", "sources"}, optional={"note"})
    try:
        number = parse(table["value"])
    except DeviceError as err:
        raise DeviceError(f"{where}.value: {err}") from None
    if number is None:
        raise DeviceError(f"{where}.value: give a number, or leave the whole figure out")
    return Figure(value=float(number), sources=_cited(table["sources"], f"{where}.sources", sources),
                  note=_note(table, where))


def _price(value: object, where: str, sources: Mapping[str, Source]) -> Price | None:
    if value is None:
        return None
    table = _table(value, where)
    _check_fields(table, where, required={"usd_per_hour", "region", "sources"}, optional={"note"})
    usd = table["usd_per_hour"]
    if isinstance(usd, bool) or not isinstance(usd, int | float) or not (math.isfinite(usd) and usd > 0):
        raise DeviceError(f"{where}.usd_per_hour: {usd!r} is not a positive number of US dollars per hour, "
                          "e.g. usd_per_hour = 32.77")
    return Price(usd_per_hour=float(usd), region=_text(table["region"], f"{where}.region"),
                 sources=_cited(table["sources"], f"{where}.sources", sources), note=_note(table, where))


def _cited(value: object, where: str, sources: Mapping[str, Source]) -> tuple[Source, ...]:
    """Source ids -> sources; a figure needs at least one, and each must be defined."""
    if not isinstance(value, list) or not value:
        raise DeviceError(f"{where}: give the ids of one or more [sources.<id>] tables, e.g. sources = [\"nvidia\"]")
    unknown = [name for name in value if name not in sources]
    if unknown:
        raise DeviceError(f"{where}: no source called {', '.join(map(repr, unknown))}; define it under "
                          f"[sources.<id>] or cite one of: {', '.join(sorted(sources))}")
    return tuple(sources[name] for name in value)


def _bandwidth(what: str) -> _Parse:
    """parse_bandwidth naming the field in its messages."""
    return functools.partial(parse_bandwidth, what=what)


def _check_fields(table: Mapping[str, object], where: str, required: set[str], optional: set[str]) -> None:
    """Every required field present and no unknown one (a misspelt field would vanish silently)."""
    missing = sorted(required - table.keys())
    if missing:
        raise DeviceError(f"{where}: missing field {', '.join(missing)}")
    unknown = sorted(table.keys() - required - optional)
    if unknown:
        raise DeviceError(f"{where}: unknown field {', '.join(map(repr, unknown))}; "
                          f"the fields are {', '.join(sorted(required | optional))}")


def _table(value: object, where: str) -> Mapping[str, object]:
    if not isinstance(value, Mapping):
        raise DeviceError(f"{where}: expected a table of fields, got {type(value).__name__} {value!r}")
    return value


def _text(value: object, where: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise DeviceError(f"{where}: expected a non-empty string, got {value!r}")
    return value


def _note(table: Mapping[str, object], where: str) -> str:
    note = table.get("note", "")
    if not isinstance(note, str):
        raise DeviceError(f"{where}.note: expected a string, got {note!r}")
    return note


def _date(value: object, where: str) -> date:
    """A TOML date or an ISO 'YYYY-MM-DD' string (JSON has no date type)."""
    if isinstance(value, datetime):
        return value.date()
    if isinstance(value, date):
        return value
    if isinstance(value, str):
        try:
            return date.fromisoformat(value)
        except ValueError:
            pass
    raise DeviceError(f"{where}: {value!r} is not a date; write it like 2026-11-26")


def _choice(value: object, kind: type[_Choice], where: str) -> _Choice:
    """The enum member a string names (kind = "cuda" -> AcceleratorKind.CUDA)."""
    if isinstance(value, str) and value in {member.value for member in kind}:
        return kind(value)
    raise DeviceError(f"{where}: {value!r} is not one of {', '.join(m.value for m in kind)}")
