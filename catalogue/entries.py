"""The device catalogue: accelerator kinds and cloud instance types, every figure with its source.

It lets the planner reason about hardware this machine does not have (`sw.plan` for "8xH100",
`sw.recommend` weighing instance type x count against time and cost). Figures are the vendor's
peak numbers, never measurements of this host: peak FLOP/s are dense (no 2:4 sparsity) and every
bandwidth is bytes/s in ONE direction (vendors often print both directions added: NVIDIA's
"900 GB/s NVLink" is 450 GB/s each way). A figure nobody could source is absent, not guessed; the
entry's `note` says so. The shipped data is catalogue/data.json; catalogue/files.py reads it
and the user's own files.
"""

from __future__ import annotations

import difflib
import enum
from dataclasses import dataclass, field
from datetime import date

from stagewise.ir.errors import DeviceError


class Dtype(enum.StrEnum):
    """The number formats a peak FLOP/s figure is quoted for. fp32 is the plain CUDA-core rate;
    tf32 is fp32 matmuls on tensor cores (torch's allow_tf32), a different figure."""

    FP32 = "fp32"
    TF32 = "tf32"
    BF16 = "bf16"
    FP16 = "fp16"


class AcceleratorKind(enum.StrEnum):
    """The torch device type an accelerator becomes."""

    CUDA = "cuda"
    CPU = "cpu"


class SourceKind(enum.StrEnum):
    """Who stands behind a figure: the maker or seller itself, a third party quoting or deriving
    it, or the user's own measurement."""

    VENDOR = "vendor"
    THIRD_PARTY = "third_party"
    MEASURED = "measured"


@dataclass(frozen=True)
class Source:
    """Where a figure comes from: `published` is the document's own date when it shows one,
    `accessed` the day it was read (prices and specs change)."""

    url: str
    title: str
    accessed: date
    kind: SourceKind
    published: date | None = None


@dataclass(frozen=True)
class Figure:
    """One number (bytes, FLOP/s or bytes/s) and the sources it was read from; `note` says how it
    was derived when it is not printed as is (half of a two-way or sparse figure)."""

    value: float
    sources: tuple[Source, ...]
    note: str = ""


@dataclass(frozen=True)
class Price:
    """USD per instance-hour in one region, as of its sources' dates."""

    usd_per_hour: float
    region: str
    sources: tuple[Source, ...]
    note: str = ""


@dataclass(frozen=True)
class PeakFlops:
    """Dense peak FLOP/s per dtype; None where the part has no such unit or no source was found."""

    fp32: Figure | None = None
    tf32: Figure | None = None
    bf16: Figure | None = None
    fp16: Figure | None = None

    def figure(self, dtype: Dtype) -> Figure | None:
        return getattr(self, dtype.value)

    def dtypes(self) -> tuple[Dtype, ...]:
        """The dtypes that have a figure."""
        return tuple(d for d in Dtype if self.figure(d) is not None)

    def figures(self) -> tuple[Figure, ...]:
        return tuple(f for d in Dtype if (f := self.figure(d)) is not None)


@dataclass(frozen=True)
class Accelerator:
    """One accelerator model: what a single device of it holds and how fast it computes and moves
    bytes (memory in bytes, `host_bandwidth` the PCIe link to the host, one direction)."""

    name: str
    kind: AcceleratorKind
    aliases: tuple[str, ...] = ()
    memory: Figure | None = None
    peak_flops: PeakFlops = PeakFlops()
    memory_bandwidth: Figure | None = None
    host_bandwidth: Figure | None = None
    note: str = ""

    def figures(self) -> tuple[Figure, ...]:
        """Every figure the entry has, for checks that each carries a source."""
        optional = (self.memory, self.memory_bandwidth, self.host_bandwidth)
        return tuple(f for f in optional if f is not None) + self.peak_flops.figures()

    @property
    def measured(self) -> bool:
        """Whether any figure comes from a measurement (sw.probe_accelerator, or the user's own)
        rather than a datasheet: plans and recommendations say which they rest on."""
        return any(source.kind is SourceKind.MEASURED for figure in self.figures() for source in figure.sources)


@dataclass(frozen=True)
class InstanceType:
    """A rentable machine: `accelerators` devices of `accelerator` (a catalogue name or alias).
    `intra_node_bandwidth` is what one device can send to the others of its instance (NVLink /
    NVSwitch, or PCIe where there is none), `inter_node_bandwidth` what the whole instance can send
    to another instance; both bytes/s, one direction. `host_memory` is the instance's RAM in bytes,
    which its devices share: what a plan keeps in host memory must fit in it."""

    name: str
    provider: str
    accelerator: str
    accelerators: int
    intra_node_bandwidth: Figure | None = None
    inter_node_bandwidth: Figure | None = None
    on_demand: Price | None = None
    spot: Price | None = None
    note: str = ""
    host_memory: Figure | None = None

    def figures(self) -> tuple[Figure, ...]:
        optional = (self.intra_node_bandwidth, self.inter_node_bandwidth, self.host_memory)
        return tuple(f for f in optional if f is not None)

    def prices(self) -> tuple[Price, ...]:
        return tuple(p for p in (self.on_demand, self.spot) if p is not None)


def _key(name: str) -> str:
    """Names match case-insensitively: 'h100' finds 'H100'."""
    return name.casefold()


@dataclass(frozen=True)
class Catalogue:
    """Accelerators and instance types, looked up by name or alias (case-insensitive): what
    `sw.recommend`, `sw.parse_device_request` and `sw.probe_accelerator` read hardware figures and
    prices from. Get one with `sw.load_catalogue()`; built checked.

    Args:
        accelerators: the accelerator models.
        instance_types: the rentable machines, each holding accelerators of the catalogue.

    Raises:
        DeviceError: a name or alias claimed twice, or an instance type whose accelerator the
            catalogue lacks.

    Example:
        >>> catalogue = sw.load_catalogue()
        >>> catalogue.accelerator("h100").name, catalogue.instance_type("p4d.24xlarge").accelerators
        ('H100-SXM-80GB', 8)
    """

    accelerators: tuple[Accelerator, ...]
    instance_types: tuple[InstanceType, ...] = ()
    _index: dict[str, Accelerator] = field(init=False, repr=False, compare=False, hash=False)
    _instances: dict[str, InstanceType] = field(init=False, repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_index", _accelerator_index(self.accelerators))
        object.__setattr__(self, "_instances", _instance_index(self.instance_types, self._index))
        for instance in self.instance_types:
            self.accelerator_of(instance)

    def accelerator(self, name: str) -> Accelerator:
        """An accelerator by name.

        Args:
            name: its name or one of its aliases, in any case.

        Returns:
            The `Accelerator`, with its figures and their sources.

        Raises:
            DeviceError: no accelerator answers to the name (the message lists those that do).

        Example:
            >>> sw.load_catalogue().accelerator("H100").aliases
            ('H100', 'H100-SXM', 'H100-SXM5')
        """
        found = self._index.get(_key(name))
        if found is None:
            raise DeviceError(_unknown("accelerator", name, self.accelerator_names(),
                                       [a for acc in self.accelerators for a in acc.aliases]))
        return found

    def instance_type(self, name: str) -> InstanceType:
        """An instance type by name.

        Args:
            name: its name, in any case ('p4d.24xlarge').

        Returns:
            The `InstanceType`: its accelerators, links and prices.

        Raises:
            DeviceError: no instance type has the name (the message lists those that do).

        Example:
            >>> sw.load_catalogue().instance_type("P4D.24xlarge").accelerator
            'A100-SXM-40GB'
        """
        found = self._instances.get(_key(name))
        if found is None:
            raise DeviceError(_unknown("instance type", name, self.instance_type_names(), []))
        return found

    def accelerator_of(self, instance: InstanceType) -> Accelerator:
        """The accelerator an instance type holds.

        Args:
            instance: an instance type, of this catalogue or another.

        Returns:
            This catalogue's accelerator of that name.

        Raises:
            DeviceError: the catalogue lacks it.

        Example:
            >>> catalogue = sw.load_catalogue()
            >>> catalogue.accelerator_of(catalogue.instance_type("p5.48xlarge")).name
            'H100-SXM-80GB'
        """
        if _key(instance.accelerator) not in self._index:
            raise DeviceError(f"instance type {instance.name!r} holds accelerator {instance.accelerator!r}, "
                              f"which the catalogue lacks; known: {', '.join(self.accelerator_names())}. "
                              "Add the accelerator to your catalogue file or name a known one")
        return self._index[_key(instance.accelerator)]

    def knows_accelerator(self, name: str) -> bool:
        """Whether an accelerator answers to a name, without raising.

        Args:
            name: a name or alias, in any case.

        Returns:
            True if `accelerator(name)` finds one.

        Example:
            >>> sw.load_catalogue().knows_accelerator("h100"), sw.load_catalogue().knows_accelerator("Z9")
            (True, False)
        """
        return _key(name) in self._index

    def knows_instance_type(self, name: str) -> bool:
        """Whether an instance type has a name, without raising.

        Args:
            name: a name, in any case.

        Returns:
            True if `instance_type(name)` finds one.

        Example:
            >>> sw.load_catalogue().knows_instance_type("p4d.24xlarge")
            True
        """
        return _key(name) in self._instances

    def accelerator_names(self) -> list[str]:
        """The accelerators' names (aliases aside).

        Returns:
            The names, sorted.

        Example:
            >>> sw.load_catalogue().accelerator_names()[:3]
            ['A100-SXM-40GB', 'A100-SXM-80GB', 'A10G-24GB']
        """
        return sorted(a.name for a in self.accelerators)

    def instance_type_names(self) -> list[str]:
        """The instance types' names.

        Returns:
            The names, sorted.

        Example:
            >>> sw.load_catalogue().instance_type_names()[:2]
            ['a2-highgpu-1g', 'a2-highgpu-8g']
        """
        return sorted(i.name for i in self.instance_types)


def _accelerator_index(accelerators: tuple[Accelerator, ...]) -> dict[str, Accelerator]:
    """Name and alias -> accelerator; a name or alias claimed twice is refused."""
    index: dict[str, Accelerator] = {}
    for accelerator in accelerators:
        for name in (accelerator.name, *accelerator.aliases):
            other = index.get(_key(name))
            if other is not None and other is not accelerator:
                raise DeviceError(f"accelerators {other.name!r} and {accelerator.name!r} both answer to "
                                  f"{name!r}; rename one or drop the alias")
            index[_key(name)] = accelerator
    return index


def _instance_index(instances: tuple[InstanceType, ...],
                    accelerators: dict[str, Accelerator]) -> dict[str, InstanceType]:
    """Name -> instance type; a name used twice, or also by an accelerator, is refused (a request
    like '2xNAME' must mean one thing)."""
    index: dict[str, InstanceType] = {}
    for instance in instances:
        key = _key(instance.name)
        if key in index or key in accelerators:
            raise DeviceError(f"the name {instance.name!r} is used twice in the catalogue (instance types and "
                              "accelerators share one namespace); rename one")
        index[key] = instance
    return index


def closest_names(name: str, candidates: list[str]) -> list[str]:
    """Up to three candidates `name` may have meant: those it begins ('p4d' -> 'p4d.24xlarge'),
    then the most similar."""
    starting = [c for c in sorted(candidates) if _key(c).startswith(_key(name))]
    similar = difflib.get_close_matches(name, candidates, n=3, cutoff=0.5)
    return list(dict.fromkeys(starting + similar))[:3]


def _unknown(what: str, name: str, known: list[str], aliases: list[str]) -> str:
    """The message for a name the catalogue lacks: the closest names, then all of them."""
    close = closest_names(name, known + aliases)
    hint = f"did you mean {' or '.join(map(repr, close))}? " if close else ""
    alias_list = f" (aliases: {', '.join(sorted(aliases))})" if aliases else ""
    return (f"unknown {what} {name!r}; {hint}known {what}s: {', '.join(known)}{alias_list}. "
            "Add your own with sw.load_catalogue('my_devices.toml')")
