"""How fast each pair of devices can talk: a link bandwidth matrix and the hierarchy behind it.

PipeDream (Fig. 2.6, §2.4.1) models a cluster as levels: m_1 devices joined by bandwidth B_1
form a server, m_2 servers joined by B_2 form the cluster, and so on. Its partitioner works
level by level; the CP-SAT binder and the simulator need the flat form, the bandwidth of the
link between every pair (i, j). `Topology` keeps both: `bandwidth[i][j]` in bytes/s, and the
`levels` it was built from (empty when the matrix came from measurements).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

from stagewise.ir.devices import parse_bandwidth
from stagewise.ir.errors import DeviceError


@dataclass(frozen=True)
class Level:
    """Level k of the hierarchy: `workers` components of level k-1 joined by `bandwidth` bytes/s."""

    workers: int
    bandwidth: float


@dataclass(frozen=True)
class Topology:
    """`bandwidth[i][j]`: bytes/s from device i to device j (the diagonal is unused: a device
    sends to itself for free). `levels`, innermost first, when the matrix is hierarchical."""

    bandwidth: tuple[tuple[float, ...], ...]
    levels: tuple[Level, ...] = ()

    def __post_init__(self) -> None:
        n = len(self.bandwidth)
        if n == 0 or any(len(row) != n for row in self.bandwidth):
            raise DeviceError(f"a topology needs a square bandwidth matrix, one row per device; got {n} rows")
        if any(not b > 0 for i, row in enumerate(self.bandwidth) for j, b in enumerate(row) if i != j):
            raise DeviceError("every link bandwidth of a topology must be positive bytes/s")
        if self.levels and math.prod(level.workers for level in self.levels) != n:
            raise DeviceError(
                f"the topology's levels hold {math.prod(lv.workers for lv in self.levels)} devices, "
                f"its matrix {n}"
            )

    # ---- constructors ---------------------------------------------------------------------------
    @classmethod
    def uniform(cls, n: int, bandwidth: float | str) -> Topology:
        """n devices on one switch: every link has the same bandwidth ('25GB/s' or bytes/s)."""
        return cls.hierarchical([(n, bandwidth)])

    @classmethod
    def two_level(cls, servers: int, per_server: int, intra: float | str, inter: float | str) -> Topology:
        """`servers` servers of `per_server` devices: `intra` within a server, `inter` across.

        Devices are numbered server by server: device i is on server i // per_server.
        """
        return cls.hierarchical([(per_server, intra), (servers, inter)])

    @classmethod
    def hierarchical(cls, levels) -> Topology:
        """PipeDream Fig. 2.6: `levels` as (workers, bandwidth) pairs, innermost first.

        Two devices talk over the bandwidth of the lowest level whose group holds both.
        """
        parsed = tuple(Level(int(w), parse_bandwidth(b, "link bandwidth")) for w, b in levels)
        if not parsed or any(level.workers < 1 for level in parsed):
            raise DeviceError("a topology needs at least one level of at least one worker")
        n = math.prod(level.workers for level in parsed)
        matrix = tuple(
            tuple(math.inf if i == j else parsed[_common_level(parsed, i, j)].bandwidth for j in range(n))
            for i in range(n)
        )
        return cls(matrix, parsed)

    @classmethod
    def from_matrix(cls, matrix) -> Topology:
        """A measured or hand-written matrix (the diagonal is ignored)."""
        n = len(matrix)
        return cls(
            tuple(
                tuple(math.inf if i == j else parse_bandwidth(matrix[i][j], "link bandwidth") for j in range(n))
                for i in range(n)
            )
        )

    # ---- queries --------------------------------------------------------------------------------
    @property
    def n_devices(self) -> int:
        return len(self.bandwidth)

    def link(self, src: int, dst: int) -> float:
        """Bytes/s from src to dst; math.inf for a device and itself."""
        return math.inf if src == dst else self.bandwidth[src][dst]

    def links(self) -> dict[tuple[int, int], float]:
        """Every off-diagonal link, in the form `SimCost.links` takes."""
        n = self.n_devices
        return {(i, j): self.bandwidth[i][j] for i in range(n) for j in range(n) if i != j}

    def group(self, device: int, level: int) -> int:
        """Index of the level-`level` group (0: the device itself, 1: its server, ...) holding device."""
        size = math.prod(lv.workers for lv in self.levels[:level])
        return device // size

    def level_between(self, src: int, dst: int) -> int:
        """The level whose link joins two devices (0 for one device, 1 within a server, ...)."""
        if src == dst:
            return 0
        if not self.levels:
            return 1
        return _common_level(self.levels, src, dst) + 1

    # ---- JSON -----------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        """JSON-friendly: the diagonal (infinite) is written as null."""
        return {
            "bandwidth": [[None if math.isinf(b) else b for b in row] for row in self.bandwidth],
            "levels": [[lv.workers, lv.bandwidth] for lv in self.levels],
        }

    @classmethod
    def from_dict(cls, data: dict) -> Topology:
        matrix = tuple(
            tuple(math.inf if b is None else float(b) for b in row) for row in data["bandwidth"]
        )
        return cls(matrix, tuple(Level(int(w), float(b)) for w, b in data.get("levels", ())))

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @classmethod
    def from_json(cls, text: str) -> Topology:
        return cls.from_dict(json.loads(text))


def _common_level(levels, i: int, j: int) -> int:
    """Index into `levels` of the innermost level whose groups put i and j together."""
    size = 1
    for k, level in enumerate(levels):
        size *= level.workers
        if i // size == j // size:
            return k
    raise DeviceError(f"devices {i} and {j} lie outside the topology")
