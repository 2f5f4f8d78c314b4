"""What compile measures about this machine beside the layers (the runtime's thread hand-off, the
optimizer step, how in-process CPU devices share the cores), kept on disk per machine.

Measured afresh in every process these figures followed the machine's load (six compiles of one
MLP on 2 CPU devices: a hand-off of 10 to 34 µs, two devices computing at once each at 0.30 to 1.00
of their speed alone, predictions 2.3 to 6.0 ms), and the plan chosen followed them. Each figure is
measured once per machine as the least-disturbed of several repeats, kept, and read back by every
later process: the same script plans with the same figures. A machine is its host name, its
processor, the cores this process may use, torch's intra-op threads and the torch version; delete
$STAGEWISE_CACHE/machine (default ~/.cache/stagewise/machine) to measure again.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import platform
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch

from stagewise.passes.profile_cache import cache_root

Figures = TypeVar("Figures")  # a float, or a frozen dataclass of floats and tuples of floats
_IN_MEMORY: dict[str, Any] = {}  # by kind and key: one process measures or reads each figure once


def machine() -> tuple:
    """What makes two processes' measurements comparable."""
    return (platform.node(), _processor(), len(os.sched_getaffinity(0)), torch.get_num_threads(),
            torch.__version__)


def _processor() -> str:
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    return next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")),
                platform.processor())


def remembered(kind: str, key: object, measure: Callable[[], Figures], figures: type[Figures]) -> Figures:
    """The figures of `kind` for `key` on this machine: read from the cache, else measured and kept."""
    name = f"{kind}-{hashlib.sha256(repr((machine(), key)).encode()).hexdigest()[:24]}"
    if name in _IN_MEMORY:
        return _IN_MEMORY[name]
    path = cache_root() / "machine" / f"{name}.json"
    try:
        value = _decode(figures, json.loads(path.read_text()))
    except (OSError, ValueError, TypeError, KeyError):
        value = measure()
        _write(path, dataclasses.asdict(value) if dataclasses.is_dataclass(value) else value)  # type: ignore[arg-type]  # a dataclass instance here
    _IN_MEMORY[name] = value
    return value


def forget_in_memory() -> None:
    """Drop what this process has read or measured (the files stay): the next use reads the disk."""
    _IN_MEMORY.clear()


def _decode(figures: type[Figures], data: Any) -> Figures:
    if dataclasses.is_dataclass(figures):
        return figures(**{name: tuple(v) if isinstance(v, list) else v for name, v in data.items()})
    if not isinstance(data, (int, float)):
        raise TypeError(f"a cached {figures.__name__} that is not a number")
    return figures(data)  # type: ignore[call-arg]  # float(number)


def _write(path: Path, data: Any) -> None:
    """Atomically; a cache that cannot be written is not an error."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data))
        os.replace(tmp, path)
    except OSError:
        pass
