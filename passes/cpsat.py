"""Binding stages (or packs) to heterogeneous devices with OR-Tools CP-SAT.

PipeDream's DP (§2.4.1 of Narayanan's dissertation) assumes identical workers in a regular
hierarchy. Real device sets differ in speed, memory and the bandwidth of each pair's link (the
`Topology`'s matrix, ir/topology.py), and then which stage goes where matters: a stage is as
fast as the device it lands on, and a cut is as fast as the link between the two devices that
share it. Both problems below minimise the bottleneck of the pipeline, the slowest of

* the compute of each device (work / speed, summed over what is bound to it), and
* the transfer across each cut, 2 a / bandwidth (activation forward, gradient backward,
  as in PipeDream's recurrence),

subject to memory. CP-SAT works on integers, so times are scaled to integer ticks (about 10^6
ticks for the largest time); the returned bottleneck is recomputed in floating point from the
chosen assignment, so it is exact for that assignment and within a tick of the optimum.

`bind_blocks` binds given contiguous stages (one per device) or Harmony packs (several per
device, run one at a time, so each pack alone must fit). `partition_and_bind` also chooses the
contiguous partition: it is exact, and meant for small instances, where it checks the DP and
the heuristics.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from ortools.sat.python import cp_model

from stagewise.ir.topology import Topology
from stagewise.passes.pipedream_dp import NoFeasiblePlan

TICKS = 1_000_000  # integer resolution of the largest time coefficient


class Worker(Protocol):
    """What the binder reads of a device (a `DeviceSpec` has both): `speed` in work units per
    second, `memory` in bytes (None: unlimited)."""

    @property
    def speed(self) -> float: ...

    @property
    def memory(self) -> float | None: ...


def _fits(device: Worker, nbytes: float) -> bool:
    return device.memory is None or nbytes <= device.memory


def _cut_time(nbytes: float, topology: Topology, src: int, dst: int) -> float:
    """2 a / B: the activation forward and its gradient backward; free on one device."""
    if src == dst or nbytes == 0:
        return 0.0
    return 2.0 * nbytes / topology.link(src, dst)


def _check_machine(devices: Sequence[Worker], topology: Topology) -> None:
    if len(devices) != topology.n_devices:
        raise ValueError(f"{len(devices)} devices on a topology of {topology.n_devices}: "
                         "give the topology one row of links per device")


@dataclass(frozen=True)
class Block:
    """A contiguous stage or pack: compute `work`, `memory` bytes, `out_bytes` sent to the next."""

    work: float
    memory: float
    out_bytes: float = 0.0


@dataclass(frozen=True)
class Binding:
    """Device of each block, in block order, and the resulting bottleneck time."""

    devices: tuple[int, ...]
    bottleneck: float
    optimal: bool


@dataclass(frozen=True)
class BoundSpan:
    """Layers first..last (inclusive) on one device."""

    first: int
    last: int
    device: int


@dataclass(frozen=True)
class PartitionBinding:
    """Contiguous stages, each on its own device, and the bottleneck time."""

    stages: tuple[BoundSpan, ...]
    bottleneck: float
    optimal: bool


def binding_time(blocks: Sequence[Block], placement: Sequence[int], devices: Sequence[Worker],
                 topology: Topology) -> float:
    """Bottleneck of blocks placed on devices: busiest device or slowest cut (INF: does not fit)."""
    if any(not _fits(devices[d], b.memory) for b, d in zip(blocks, placement, strict=True)):
        return math.inf
    load = [0.0] * len(devices)
    for block, device in zip(blocks, placement, strict=True):
        load[device] += block.work / devices[device].speed
    cuts = [_cut_time(blocks[i].out_bytes, topology, placement[i], placement[i + 1]) for i in range(len(blocks) - 1)]
    return max(load + cuts)


def _scale(values: Sequence[float]) -> float:
    """Ticks per second so the largest time is about TICKS ticks."""
    top = max((v for v in values if math.isfinite(v)), default=0.0)
    return TICKS / top if top > 0 else 1.0


def _solve(model: cp_model.CpModel, time_limit_s: float,
           workers: int) -> tuple[cp_model.CpSolver, cp_model.CpSolverStatus]:
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = time_limit_s
    solver.parameters.num_workers = workers
    status = solver.solve(model)
    return solver, status


def _no_solution(solver: cp_model.CpSolver, status: cp_model.CpSolverStatus, what: str) -> NoFeasiblePlan:
    if status == cp_model.INFEASIBLE:
        return NoFeasiblePlan(f"{what}: CP-SAT proved that no assignment fits the devices' memory. "
                              "Add devices or memory, or use smaller stages/packs.")
    return NoFeasiblePlan(f"{what}: CP-SAT found no assignment within the time limit "
                          f"(status {solver.status_name(status)}). Raise time_limit_s.")


def bind_blocks(blocks: Sequence[Block], devices: Sequence[Worker], topology: Topology, *,
                one_per_device: bool = True, time_limit_s: float = 10.0, workers: int = 2) -> Binding:
    """Bind contiguous blocks to devices minimising the bottleneck.

    one_per_device=True: blocks are pipeline stages, each on its own device (needs at least as
    many devices as blocks); a stage must fit its device's memory.
    one_per_device=False: blocks are Harmony packs; a device may run several, its time is the
    sum, and each pack must fit on its own (packs are swapped in one at a time).
    Raises NoFeasiblePlan when no binding fits.
    """
    _check_machine(devices, topology)
    n_blocks, n_dev = len(blocks), len(devices)
    if one_per_device and n_blocks > n_dev:
        raise NoFeasiblePlan(f"{n_blocks} stages need {n_blocks} devices, only {n_dev} given")
    compute = [[b.work / dev.speed for dev in devices] for b in blocks]
    transfer = [[[_cut_time(blocks[i].out_bytes, topology, d, e) for e in range(n_dev)]
                 for d in range(n_dev)] for i in range(n_blocks - 1)]
    scale = _scale([x for row in compute for x in row] + [x for m in transfer for r in m for x in r])

    model = cp_model.CpModel()
    x = [[model.new_bool_var(f"x{i}_{d}") for d in range(n_dev)] for i in range(n_blocks)]
    horizon = sum(math.ceil(max(row) * scale) for row in compute) + TICKS + 1
    bottleneck = model.new_int_var(0, horizon, "bottleneck")
    for i, block in enumerate(blocks):
        model.add_exactly_one(x[i])
        for d in range(n_dev):
            if not _fits(devices[d], block.memory):
                model.add(x[i][d] == 0)
    for d in range(n_dev):
        column = [x[i][d] for i in range(n_blocks)]
        if one_per_device:
            model.add_at_most_one(column)
        model.add(sum(round(compute[i][d] * scale) * x[i][d] for i in range(n_blocks)) <= bottleneck)
    _add_cut_constraints(model, bottleneck, x, x[1:], transfer, scale)
    model.minimize(bottleneck)

    solver, status = _solve(model, time_limit_s, workers)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        raise _no_solution(solver, status, f"binding {n_blocks} blocks to {n_dev} devices")
    placement = tuple(next(d for d in range(n_dev) if solver.value(x[i][d])) for i in range(n_blocks))
    return Binding(placement, binding_time(blocks, placement, devices, topology), status == cp_model.OPTIMAL)


def _add_cut_constraints(model: cp_model.CpModel, bottleneck: cp_model.IntVar,
                         left: Sequence[Sequence[cp_model.IntVar]], right: Sequence[Sequence[cp_model.IntVar]],
                         transfer: Sequence[Sequence[Sequence[float]]], scale: float) -> None:
    """bottleneck >= t[d][e] whenever the two sides of cut i sit on d and e.

    Linear without pairing variables: t (left_d + right_e - 1) is t when both hold, else <= 0.
    """
    for i, times in enumerate(transfer):
        for d, row in enumerate(times):
            for e, t in enumerate(row):
                ticks = round(t * scale)
                if ticks > 0:
                    model.add(bottleneck >= ticks * (left[i][d] + right[i][e] - 1))


def partition_and_bind(work: Sequence[float], activation_bytes: Sequence[float], memory: Sequence[float],
                       devices: Sequence[Worker], topology: Topology, *, cut_allowed: Sequence[bool] | None = None,
                       time_limit_s: float = 30.0, workers: int = 2) -> PartitionBinding:
    """Choose contiguous stages of the layers and a distinct device for each, exactly.

    Layer l has compute `work[l]`, output `activation_bytes[l]` and `memory[l]` bytes on the
    device that holds it (fold the stash for the planned in-flight inputs into it). Devices may
    stay unused. Each device's layers must form one contiguous run: at most one layer starts
    a run on it. Meant for small instances (tens of layers, a handful of devices).
    """
    _check_machine(devices, topology)
    n, n_dev = len(work), len(devices)
    compute = [[w / dev.speed for dev in devices] for w in work]
    transfer = [[[_cut_time(activation_bytes[i], topology, d, e) for e in range(n_dev)]
                 for d in range(n_dev)] for i in range(n - 1)]
    scale = _scale([sum(max(row) for row in compute)] + [x for m in transfer for r in m for x in r])

    model = cp_model.CpModel()
    z = [[model.new_bool_var(f"z{i}_{d}") for d in range(n_dev)] for i in range(n)]
    bottleneck = model.new_int_var(0, 2 * TICKS + n, "bottleneck")
    for i in range(n):
        model.add_exactly_one(z[i])
        if cut_allowed is not None and i < n - 1 and not cut_allowed[i]:
            for d in range(n_dev):
                model.add(z[i][d] == z[i + 1][d])
    for d in range(n_dev):
        _add_contiguity(model, [z[i][d] for i in range(n)])
        model.add(sum(round(compute[i][d] * scale) * z[i][d] for i in range(n)) <= bottleneck)
        capacity = devices[d].memory
        if capacity is not None:
            # bytes as integers: exact for whole bytes, conservative for fractions
            need = sum(math.ceil(memory[i]) * z[i][d] for i in range(n))
            model.add(need <= math.floor(capacity))
    _add_cut_constraints(model, bottleneck, z, z[1:], transfer, scale)
    model.minimize(bottleneck)

    solver, status = _solve(model, time_limit_s, workers)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        raise _no_solution(solver, status, f"partitioning {n} layers over {n_dev} devices")
    owner = [next(d for d in range(n_dev) if solver.value(z[i][d])) for i in range(n)]
    stages = _runs(owner)
    blocks = [Block(sum(work[s.first:s.last + 1]), sum(memory[s.first:s.last + 1]), activation_bytes[s.last])
              for s in stages]
    time = binding_time(blocks, [s.device for s in stages], devices, topology)
    return PartitionBinding(tuple(stages), time, status == cp_model.OPTIMAL)


def _add_contiguity(model: cp_model.CpModel, on: Sequence[cp_model.IntVar]) -> None:
    """The layers on one device form one run: at most one position starts a run."""
    starts = []
    for i, var in enumerate(on):
        start = model.new_bool_var("")
        model.add(start >= var - (on[i - 1] if i else 0))
        starts.append(start)
    model.add_at_most_one(starts)


def _runs(owner: Sequence[int]) -> list[BoundSpan]:
    stages, first = [], 0
    for i in range(1, len(owner) + 1):
        if i == len(owner) or owner[i] != owner[first]:
            stages.append(BoundSpan(first, i - 1, owner[first]))
            first = i
    return stages
