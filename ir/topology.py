"""How fast each pair of devices can talk: a link bandwidth matrix and the hierarchy behind it.

PipeDream (Fig. 2.6, §2.4.1) models a cluster as levels: m_1 devices joined by bandwidth B_1
form a server, m_2 servers joined by B_2 form the cluster, and so on. Its partitioner works
level by level; the CP-SAT binder and the simulator need the flat form, the bandwidth of the
link between every pair (i, j). `Topology` keeps both: `bandwidth[i][j]` in bytes/s, and the
`levels` it was built from (empty when the matrix came from measurements). compile() measures
the matrix between the devices it is given (compiler/compile/calibrate.py); the planner reads the links
of the devices a pipeline uses (`among`), PipeDream's DP their levels (`hierarchy`), CP-SAT every
pair, and the simulator every link (`links`).

Swaps cross each device's link to its host's memory (`host_links`: PCIe, or a CPU's memory copy),
shared by the devices behind one host (`host_of`), never the links between devices.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace

from stagewise.ir.devices import parse_bandwidth
from stagewise.ir.errors import DeviceError
from stagewise.ir.topology_levels import Level, common_level, leading_levels

__all__ = ["Level", "Topology"]


@dataclass(frozen=True)
class Topology:
    """How fast each pair of devices talks, for the planner and the simulator: `sw.plan(topology=)`
    for devices not here (compile measures its own); built with `uniform`, `two_level`,
    `hierarchical` or `from_matrix`.

    Args:
        bandwidth: `bandwidth[i][j]`, bytes/s from device i to device j; None on the diagonal (a
            device has no link to itself: it sends to itself for free).
        levels: the hierarchy the matrix came from, innermost first; () for a measured matrix.
        host_links: bytes/s between each device and its host's memory (what swaps cross); () until
            the cost phase fills them in from the devices' figures or measurements.
        hosts: which host each device sits behind (devices of one host share its memory for
            swaps); () for the groups of the innermost level, or one host without levels.

    Raises:
        DeviceError: a matrix that is not square, a link that is not positive, a diagonal that is
            not None, levels that hold another number of devices than the matrix, or host links or
            hosts not one per device.

    Example:
        >>> topology = sw.Topology.two_level(2, 2, intra="100GB/s", inter="10GB/s")
        >>> topology.n_devices, topology.link(0, 1), topology.link(0, 2)
        (4, 100000000000.0, 10000000000.0)
    """

    bandwidth: tuple[tuple[float | None, ...], ...]
    levels: tuple[Level, ...] = ()
    host_links: tuple[float, ...] = ()
    hosts: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        n = len(self.bandwidth)
        if n == 0 or any(len(row) != n for row in self.bandwidth):
            raise DeviceError(f"a topology needs a square bandwidth matrix, one row per device; got {n} rows")
        if any((b is not None) if i == j else not (b is not None and b > 0)
               for i, row in enumerate(self.bandwidth) for j, b in enumerate(row)):
            raise DeviceError("every link bandwidth of a topology must be positive bytes/s, and the diagonal "
                              "None (a device has no link to itself)")
        if self.levels and math.prod(level.workers for level in self.levels) != n:
            raise DeviceError(
                f"the topology's levels hold {math.prod(lv.workers for lv in self.levels)} devices, "
                f"its matrix {n}"
            )
        if {len(self.host_links), len(self.hosts)} - {0, n} or any(not b > 0 for b in self.host_links):
            raise DeviceError(f"a topology of {n} devices takes one host per device and one host link each, "
                              "positive bytes/s (math.inf: free swaps)")

    # ---- constructors ---------------------------------------------------------------------------
    @classmethod
    def uniform(cls, n: int, bandwidth: float | str) -> Topology:
        """n devices on one switch: every link has the same bandwidth.

        Args:
            n: how many devices.
            bandwidth: every link's bytes/s, a number or '25GB/s'.

        Returns:
            A one-level topology.

        Example:
            >>> sw.Topology.uniform(2, "25GB/s")
            Topology(bandwidth=((None, 25000000000.0), (25000000000.0, None)), levels=(Level(workers=2, bandwidth=25000000000.0),), host_links=(), hosts=())
        """
        return cls.hierarchical([(n, bandwidth)])

    @classmethod
    def two_level(cls, servers: int, per_server: int, intra: float | str, inter: float | str) -> Topology:
        """`servers` servers of `per_server` devices. Devices are numbered server by server: device
        i is on server i // per_server.

        Args:
            servers: how many servers.
            per_server: devices in each server.
            intra: bytes/s between two devices of one server (a number or '100GB/s').
            inter: bytes/s between devices of two servers.

        Returns:
            A two-level topology of servers * per_server devices.

        Example:
            >>> topology = sw.Topology.two_level(2, 2, "100GB/s", "10GB/s")
            >>> topology.link(0, 1), topology.link(1, 2)
            (100000000000.0, 10000000000.0)
        """
        return cls.hierarchical([(per_server, intra), (servers, inter)])

    @classmethod
    def hierarchical(cls, levels) -> Topology:
        """PipeDream Fig. 2.6's hierarchy: two devices talk over the bandwidth of the lowest level
        whose group holds both.

        Args:
            levels: (workers, bandwidth) pairs, innermost first: `workers` groups of the level below
                joined by `bandwidth` (bytes/s or '10GB/s').

        Returns:
            The topology of the product of the levels' workers devices.

        Raises:
            DeviceError: no level, a level of no worker, or a bandwidth that is not positive.

        Example:
            >>> topology = sw.Topology.hierarchical([(2, "100GB/s"), (2, "10GB/s")])
            >>> topology == sw.Topology.two_level(2, 2, "100GB/s", "10GB/s")
            True
        """
        parsed = tuple(Level(int(w), _link_bandwidth(b)) for w, b in levels)
        if not parsed or any(level.workers < 1 for level in parsed):
            raise DeviceError("a topology needs at least one level of at least one worker")
        n = math.prod(level.workers for level in parsed)
        matrix = tuple(
            tuple(None if i == j else parsed[common_level(parsed, i, j)].bandwidth for j in range(n))
            for i in range(n)
        )
        return cls(matrix, parsed)

    @classmethod
    def from_matrix(cls, matrix) -> Topology:
        """A measured or hand-written matrix, with no hierarchy.

        Args:
            matrix: n rows of n bandwidths, bytes/s or '25GB/s'; row i is what device i sends over
                (the diagonal is ignored).

        Returns:
            The topology of n devices.

        Example:
            >>> sw.Topology.from_matrix([[None, 1e9], [2e9, None]]).link(1, 0)
            2000000000.0
        """
        n = len(matrix)
        return cls(
            tuple(
                tuple(None if i == j else _link_bandwidth(matrix[i][j]) for j in range(n))
                for i in range(n)
            )
        )

    # ---- queries --------------------------------------------------------------------------------
    @property
    def n_devices(self) -> int:
        """How many devices the topology links.

        Example:
            >>> sw.Topology.two_level(2, 4, "100GB/s", "10GB/s").n_devices
            8
        """
        return len(self.bandwidth)

    def link(self, src: int, dst: int) -> float:
        """The link between two devices.

        Args:
            src: the sending device's index.
            dst: the receiving device's index.

        Returns:
            Bytes/s from src to dst; math.inf for a device and itself.

        Example:
            >>> sw.Topology.uniform(2, 1e9).link(0, 1), sw.Topology.uniform(2, 1e9).link(0, 0)
            (1000000000.0, inf)
        """
        bandwidth = self.bandwidth[src][dst]
        return math.inf if bandwidth is None else bandwidth

    def links(self) -> dict[tuple[int, int], float]:
        """Every link between two devices, for the simulator.

        Returns:
            {(src, dst): bytes/s}, in the form `SimCost.links` takes.

        Example:
            >>> sw.Topology.uniform(2, 1e9).links()
            {(0, 1): 1000000000.0, (1, 0): 1000000000.0}
        """
        return {(i, j): b for i, row in enumerate(self.bandwidth) for j, b in enumerate(row) if b is not None}

    @property
    def slowest_link(self) -> float:
        """The least bandwidth between two devices (math.inf for one device: nothing to send).

        Example:
            >>> sw.Topology.two_level(2, 2, "100GB/s", "10GB/s").slowest_link
            10000000000.0
        """
        return min(self.links().values(), default=math.inf)

    def hierarchy(self) -> tuple[Level, ...]:
        """The levels PipeDream's DP plans over.

        Returns:
            The topology's own levels, else every device on one level joined by the slowest link
            (exact when all links are equal, conservative otherwise).

        Example:
            >>> sw.Topology.from_matrix([[None, 1e9], [2e9, None]]).hierarchy()
            (Level(workers=2, bandwidth=1000000000.0),)
        """
        return self.levels or (Level(self.n_devices, self.slowest_link),)

    def among(self, devices: Sequence[int]) -> Topology:
        """The links between some devices only, for a pipeline that uses them.

        Args:
            devices: distinct device indices, renumbered 0.. in the order given.

        Returns:
            Their topology. The levels are kept when the devices are the first k and k fills whole
            groups of the hierarchy's levels (k = 8 or 4 or 2 of 2 servers of 4), else dropped
            (`hierarchy` then flattens).

        Raises:
            DeviceError: an index out of range or given twice.

        Example:
            >>> topology = sw.Topology.two_level(2, 2, "100GB/s", "10GB/s")
            >>> topology.among([0, 2]).link(0, 1)
            10000000000.0
        """
        if any(not 0 <= d < self.n_devices for d in devices) or len(set(devices)) != len(devices):
            raise DeviceError(f"devices {list(devices)} are not distinct devices of the topology's "
                              f"{self.n_devices}")
        matrix = tuple(tuple(self.bandwidth[i][j] for j in devices) for i in devices)
        leading = list(devices) == list(range(len(devices)))
        host_links = tuple(self.host_links[d] for d in devices) if self.host_links else ()
        kept = Topology(matrix, leading_levels(self.levels, len(devices)) if leading else (), host_links)
        hosts = tuple(self.host_of(d) for d in devices)  # stated where the kept levels would not say them
        return kept if all(kept.host_of(i) == h for i, h in enumerate(hosts)) else replace(kept, hosts=hosts)

    def host_link(self, device: int) -> float:
        """The link between a device and its host's memory: what its swaps cross.

        Args:
            device: the device's index.

        Returns:
            Bytes/s one way; without host links (a plan saved before they were recorded) the
            slowest link between devices, which is what such plans were predicted with.

        Example:
            >>> sw.Topology(((None, 1e9), (1e9, None)), host_links=(25e9, 32e9)).host_link(1)
            32000000000.0
        """
        return self.host_links[device] if self.host_links else self.slowest_link

    def host_of(self, device: int) -> int:
        """The host a device sits behind: the devices of one host share its memory for swaps.

        Args:
            device: the device's index.

        Returns:
            `hosts[device]` when given, else its group of the innermost level (its server), else 0
            (one host, as the in-process devices of compile are).

        Example:
            >>> sw.Topology.two_level(2, 2, "100GB/s", "10GB/s").host_of(3)
            1
        """
        return self.hosts[device] if self.hosts else self.group(device, 1) if self.levels else 0

    def group(self, device: int, level: int) -> int:
        """Which group of a level holds a device.

        Args:
            device: the device's index.
            level: 0 for the device itself, 1 for its server, ...

        Returns:
            The index of the level-`level` group holding the device.

        Example:
            >>> sw.Topology.two_level(2, 2, "100GB/s", "10GB/s").group(3, level=1)
            1
        """
        size = math.prod(lv.workers for lv in self.levels[:level])
        return device // size

    def level_between(self, src: int, dst: int) -> int:
        """The level whose link joins two devices.

        Args:
            src: one device's index.
            dst: the other's.

        Returns:
            0 for a device and itself, 1 within a server, 2 across servers, ...

        Example:
            >>> sw.Topology.two_level(2, 2, "100GB/s", "10GB/s").level_between(0, 3)
            2
        """
        if src == dst:
            return 0
        if not self.levels:
            return 1
        return common_level(self.levels, src, dst) + 1

    # ---- JSON -----------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        """The topology as plain data.

        Returns:
            A JSON-friendly dict (the diagonal None), the form a `Plan`'s JSON holds it in.

        Example:
            >>> sw.Topology.from_matrix([[None, 1e9], [1e9, None]]).to_dict()
            {'bandwidth': ((None, 1000000000.0), (1000000000.0, None)), 'levels': (), 'host_links': (), 'hosts': ()}
        """
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> Topology:
        """The topology `to_dict` gave.

        Args:
            data: {'bandwidth': rows, 'levels': [{'workers', 'bandwidth'}, ...]}, and optionally
                'host_links' and 'hosts' (one per device).

        Returns:
            The topology, checked as the constructor checks it.

        Example:
            >>> topology = sw.Topology.uniform(2, 1e9)
            >>> sw.Topology.from_dict(topology.to_dict()) == topology
            True
        """
        matrix = tuple(tuple(None if b is None else float(b) for b in row) for row in data["bandwidth"])
        levels = tuple(Level(int(lv["workers"]), float(lv["bandwidth"])) for lv in data.get("levels", ()))
        host_links = tuple(float(b) for b in data.get("host_links", ()))
        return cls(matrix, levels, host_links, tuple(int(h) for h in data.get("hosts", ())))

    def to_json(self) -> str:
        """The topology as JSON text.

        Returns:
            `to_dict`'s dict as JSON (the diagonal null).

        Example:
            >>> sw.Topology.from_matrix([[None, 1e9], [1e9, None]]).to_json()
            '{"bandwidth": [[null, 1000000000.0], [1000000000.0, null]], "levels": [], "host_links": [], "hosts": []}'
        """
        return json.dumps(self.to_dict())

    @classmethod
    def from_json(cls, text: str) -> Topology:
        """The topology `to_json` wrote.

        Args:
            text: the JSON text.

        Returns:
            The topology, checked as the constructor checks it.

        Example:
            >>> topology = sw.Topology.uniform(2, "25GB/s")
            >>> sw.Topology.from_json(topology.to_json()) == topology
            True
        """
        return cls.from_dict(json.loads(text))


def _link_bandwidth(value: float | str | None) -> float:
    """A link's bytes/s, from a number or a string such as '25GB/s'."""
    bandwidth = parse_bandwidth(value, "link bandwidth")
    if bandwidth is None:
        raise DeviceError("every link between two devices needs a bandwidth, e.g. 25e9 or '25GB/s'")
    return bandwidth
