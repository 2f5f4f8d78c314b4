"""The topology of a torch.distributed job: the ranks of one host form the inner level, the hosts the
outer one (PipeDream's hierarchy, dissertation Fig. 2.6; ir/topology.py).

In one process every device is on one host: one level, the measured matrix (calibrate.py
`local_topology`), as before. Under torch.distributed the ranks are grouped by host name; on one
host that is still one level. Across hosts the link between them is measured once (rank 0 and the
first rank of the second host pass a buffer back and forth), and so is the link between two ranks
of rank 0's host where it holds several (rank 0 and the next rank of its host, over the process
group's own transport: gloo's TCP over loopback is far slower than the in-process copy
`local_topology` times). The levels are (ranks per host, that link inside a host), (hosts, the
link between them) when torchrun numbered the ranks host by host in equal numbers; otherwise the
matrix alone, without levels (the DP then plans over one level at the slowest link). Rank 0's
topology is the one every rank plans with.

With tensor_parallel=T the topology is the plan's P pipeline devices', not the T·P ranks': device
d's host is the host of its T ranks (`RankLayout`), which must share one, as Megatron keeps T
within a server (Narayanan §3); the links measured are those a pipeline's p2p crosses, between
ranks at position 0 of two devices.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Sequence
from dataclasses import replace

import torch
import torch.distributed as dist

from stagewise.compiler.compile.calibrate import COPY_BYTES, REPEATS, local_topology
from stagewise.ir.errors import DeviceError
from stagewise.ir.tensor_parallel import RankLayout
from stagewise.ir.topology import Topology


def cluster_topology(devices, local_rank: int, tensor_parallel: int = 1) -> Topology:
    """The links between the plan's pipeline devices, with a level per host where they are on
    several; the same on every rank (a collective: every rank calls it)."""
    local = local_topology(devices)
    ranks: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, socket.gethostname())
    layout = RankLayout(local.n_devices, tensor_parallel)
    names = device_hosts([str(h) for h in ranks], layout)
    if len(set(names)) == 1:
        return local
    device = _buffer_device(local_rank)
    between_peer, inside_peer = probe_peers(names, layout)
    between = _round_trip_bandwidth(between_peer, device)
    inside = None if inside_peer is None else _round_trip_bandwidth(inside_peer, device)
    box = [hosts_topology(names, local, between, inside)]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def device_hosts(rank_hosts: Sequence[str], layout: RankLayout) -> list[str]:
    """The host of each pipeline device of `layout`, from the host of each rank; DeviceError where
    the job is not the layout's T·P ranks or a device's T ranks are on more than one host."""
    if len(rank_hosts) != layout.world_size:
        raise DeviceError(f"{layout.devices} pipeline device(s) x tensor_parallel={layout.degree} need "
                          f"{layout.world_size} processes, but this job has {len(rank_hosts)}; launch that many, "
                          f"or give {len(rank_hosts) // layout.degree or 1} device(s)")
    hosts = []
    for device in range(layout.devices):
        ranks = layout.ranks_of(device)
        found = {rank: rank_hosts[rank] for rank in ranks}
        if len(set(found.values())) > 1:
            raise DeviceError(f"tensor_parallel={layout.degree}: pipeline device {device}'s ranks {list(ranks)} are "
                              f"on several hosts ({found}), but a tensor-parallel group must share one host's fast "
                              f"links; launch the same number of processes on each host, a multiple of "
                              f"{layout.degree} (torchrun --nproc-per-node), or lower tensor_parallel=")
        hosts.append(rank_hosts[ranks[0]])
    return hosts


def probe_peers(hosts: Sequence[str], layout: RankLayout) -> tuple[int, int | None]:
    """The ranks rank 0 times a link to: the first pipeline device on another host, and the next
    one on rank 0's host (None where it has no other), each at position 0, as a pipeline's p2p."""
    between = next(d for d, host in enumerate(hosts) if host != hosts[0])
    inside = next((d for d, host in enumerate(hosts) if d and host == hosts[0]), None)
    return layout.rank(between, 0), None if inside is None else layout.rank(inside, 0)


def host_levels(hosts: Sequence[str]) -> tuple[int, int] | None:
    """(ranks per host, hosts) when the ranks are numbered host by host, the same number on each
    (torchrun's numbering with --nproc-per-node); None otherwise."""
    order = list(dict.fromkeys(hosts))
    per_host = len(hosts) // len(order)
    if len(hosts) != per_host * len(order) or any(hosts[r] != order[r // per_host] for r in range(len(hosts))):
        return None
    return per_host, len(order)


def hosts_topology(hosts: Sequence[str], local: Topology, between: float, inside: float | None = None) -> Topology:
    """Rank i runs on `hosts[i]`: ranks of one host talk over `inside` bytes/s where measured, else
    `local`'s links, ranks of different hosts over `between` bytes/s; levels (host, cluster) where
    `host_levels` finds them."""
    n = len(hosts)
    if local.n_devices != n:
        raise ValueError(f"{n} ranks but {local.n_devices} devices measured")
    shape = host_levels(hosts)
    if shape is not None:
        per_host, count = shape
        within = (inside or local.among(range(per_host)).slowest_link) if per_host > 1 else between
        return Topology.hierarchical([(per_host, within), (count, between)])
    matrix = Topology.from_matrix([[None if i == j else (inside or local.link(i, j)) if hosts[i] == hosts[j]
                                    else between for j in range(n)] for i in range(n)])
    return replace(matrix, hosts=tuple(list(dict.fromkeys(hosts)).index(h) for h in hosts))


def _round_trip_bandwidth(peer: int, device: torch.device) -> float:
    """Bytes/s between rank 0 and `peer`, timed by rank 0 (the best of a few round trips); every
    other rank only waits for the result."""
    rank, buffer = dist.get_rank(), torch.empty(COPY_BYTES // 4, device=device)
    best = float("inf")
    for _ in range(REPEATS):  # the best counts: the first, which opens the connection, is slower
        start = time.perf_counter()
        if rank == 0:
            dist.send(buffer, peer)
            dist.recv(buffer, peer)
        elif rank == peer:
            dist.recv(buffer, 0)
            dist.send(buffer, 0)
        best = min(best, time.perf_counter() - start)
    return 2 * COPY_BYTES / max(best, 1e-9)


def _buffer_device(local_rank: int) -> torch.device:
    """NCCL sends CUDA tensors only (this rank's GPU); gloo CPU tensors."""
    return torch.device("cuda", local_rank) if dist.get_backend() == "nccl" else torch.device("cpu")
