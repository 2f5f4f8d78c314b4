"""PipeDream's levels (Fig. 2.6): groups of devices joined by one bandwidth, innermost first, and the
arithmetic on them that `Topology` (ir/topology.py) builds its matrix and its sub-topologies from."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from stagewise.ir.errors import DeviceError


@dataclass(frozen=True)
class Level:
    """Level k of the hierarchy: `workers` components of level k-1 joined by `bandwidth` bytes/s."""

    workers: int
    bandwidth: float


def leading_levels(levels: Sequence[Level], k: int) -> tuple[Level, ...]:
    """The levels of the first k devices: whole groups of each level, then a part of the next
    level's group if k ends inside one; () when k is no such count."""
    kept: list[Level] = []
    size = 1
    for level in levels:
        if size == k:
            break
        if k % (size * level.workers) == 0:
            kept.append(level)
            size *= level.workers
        elif k % size == 0 and k // size < level.workers:
            kept.append(Level(k // size, level.bandwidth))
            size = k
        else:
            break
    return tuple(kept) if size == k else ()


def common_level(levels, i: int, j: int) -> int:
    """Index into `levels` of the innermost level whose groups put i and j together."""
    size = 1
    for k, level in enumerate(levels):
        size *= level.workers
        if i // size == j // size:
            return k
    raise DeviceError(f"devices {i} and {j} lie outside the topology")
