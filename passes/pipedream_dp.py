"""PipeDream's partitioning dynamic program (Narayanan, PhD dissertation, §2.4.1).

PipeDream's optimizer "partitions DNN layers into stages such that each stage completes at
roughly the same rate" and lets a stage be replicated (data parallelism inside the stage). The
problem is to minimise the time of the slowest stage, and it has the optimal sub-problem
property: "a pipeline that maximizes throughput given a worker count is composed of
sub-pipelines that maximize throughput for smaller worker counts". So a dynamic program over
contiguous layer ranges and worker counts finds the optimum.

The machine is hierarchical (Fig. 2.6): level k is made of m_k components of level k-1 joined
by links of bandwidth B_k; m_0 = 1 is one device (the `Topology`'s levels, ir/topology.py; a
measured topology without levels is one level over its slowest link). The DPs are solved from
the lowest level to the highest: the best pipeline of a layer range inside one server becomes
the compute time of a stage replicated across servers.

Two cases the printed recurrence A^k(i->j, m) misses are candidates here (see the digest of
the dissertation, §1.2): the whole range as a single stage replicated on all m workers (pure
data parallelism, which the optimizer picks for ResNet-50), and a pipeline that uses fewer
workers than are available (PipeDream's released optimizer does this with
`use_fewer_machines`). Both fall out of solving for an *exact* worker count and taking the
minimum over counts.

Memory is checked for device-level (level-1) stages: weights once plus one stash per
in-flight input, counted with NOAM (§2.4.2) over the level-1 pipeline that holds the stage.
With several levels that count is local to one server, as in PipeDream's optimizer, which
checks each level against its own worker count; it undercounts inputs that are in flight on
other servers.

The inputs are plain lists (the per-layer profile of §2.4.1 "Profiler": T_l, a_l, |w_l|, plus
the bytes a layer stashes per in-flight input), so the DP can be checked against brute force
(tests/pipedream_oracle.py scores a plan given whole). The planner runs it over the devices'
`Topology` (passes/pipedream_partition.py): straight for the gpipe / 1f1b / varuna pipelines,
with replication for replicas="per-stage", and `plan_with_replicas` for a replication given.
`replica_devices` places a plan on devices; the runtime runs a replica of a stage on each.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from itertools import accumulate

from stagewise.ir.errors import PartitionError
from stagewise.ir.topology import Level, Topology

INF = math.inf
# Bytes each replica moves per weight byte in one all-reduce, times (r-1)/r. Ring all-reduce sends
# 2(r-1)/r |w| and receives as much, hence 4 (as in PipeDream's released optimizer); the printed
# T^k(i->j, m) uses 2.
ALLREDUCE_FACTOR = 4.0


class NoFeasiblePlan(PartitionError):
    """No partition fits: every candidate stage exceeds a device's memory (or nothing is allowed)."""


@dataclass(frozen=True)
class LayerCosts:
    """The per-layer profile PipeDream's partitioner reads (§2.4.1, "Profiler").

    compute: T_l, forward + backward seconds of layer l for one input (microbatch).
    activation_bytes: a_l, bytes of layer l's output; a cut after l sends a_l forward and a
        gradient of the same size backward.
    param_bytes: |w_l|, the weight bytes all-reduced when a stage is replicated.
    stash_bytes: bytes layer l keeps per in-flight input (stashed activations); default 0.
    resident_bytes: bytes layer l keeps once per worker (weights, gradients, optimizer state);
        default param_bytes.
    cut_allowed: cut_allowed[l] says a stage may end after layer l (len N-1); default all.
    """

    compute: Sequence[float]
    activation_bytes: Sequence[float]
    param_bytes: Sequence[float]
    stash_bytes: Sequence[float] | None = None
    resident_bytes: Sequence[float] | None = None
    cut_allowed: Sequence[bool] | None = None

    def __post_init__(self) -> None:
        n = len(self.compute)
        lists = [self.activation_bytes, self.param_bytes, self.stash_bytes, self.resident_bytes]
        if n == 0 or any(x is not None and len(x) != n for x in lists):
            raise ValueError("LayerCosts: every per-layer list must have one entry per layer (N >= 1)")
        if self.cut_allowed is not None and len(self.cut_allowed) != n - 1:
            raise ValueError("LayerCosts: cut_allowed needs N-1 entries (one per gap between layers)")

    @property
    def n_layers(self) -> int:
        return len(self.compute)

    def can_cut_after(self, layer: int) -> bool:
        return self.cut_allowed is None or bool(self.cut_allowed[layer])


@dataclass(frozen=True)
class StageSpan:
    """What the DP decides of a stage: layers first..last (inclusive) replicated on `replicas`
    workers of its level (the planner builds the IR's `Stage`s from these spans).

    For a span of level k >= 2 each replica is a whole level-(k-1) component, which runs the
    pipeline `inner` over the same layers; a level-1 span runs on devices and has no inner.
    """

    first: int
    last: int
    replicas: int
    inner: tuple[StageSpan, ...] = ()


@dataclass(frozen=True)
class PipelinePlan:
    """The partitioner's output (§2.4.1): stage spans, their replication, the bottleneck time, and
    the levels it was planned over."""

    stages: tuple[StageSpan, ...]
    bottleneck: float
    levels: tuple[Level, ...]

    @property
    def workers(self) -> int:
        """Top-level workers used (possibly fewer than available)."""
        return sum(stage.replicas for stage in self.stages)

    @property
    def in_flight(self) -> int:
        """NOAM = ceil(workers / replicas of the input stage) (§2.4.2), in top-level workers."""
        return math.ceil(self.workers / self.stages[0].replicas)

    def device_stages(self) -> list[tuple[int, int, int]]:
        """Flattened (first, last, devices running it) per device-level stage, in layer order."""
        return [(first, last, len(devices)) for first, last, devices in self.replica_devices()]

    def replica_devices(self) -> list[tuple[int, int, tuple[int, ...]]]:
        """(first, last, the devices of its replicas) per device-level stage, in layer order, devices
        numbered group by group as in `Topology.hierarchical`: a level-k stage on r workers takes the
        next r whole level-(k-1) groups, and each of its inner stages one set of devices in every one
        of them. A plan that leaves workers idle leaves the last devices idle."""
        return _place(self.stages, len(self.levels), 0, self.levels)

    def placed_stages(self) -> list[tuple[int, int, int]]:
        """(first, last, device) per device-level stage of a straight plan (one device each)."""
        placed = self.replica_devices()
        replicated = [(first, last) for first, last, devices in placed if len(devices) != 1]
        if replicated:
            raise ValueError(f"layers {replicated} are replicated: only a straight plan puts one device on each stage")
        return [(first, last, devices[0]) for first, last, devices in placed]


def _place(stages: Sequence[StageSpan], k: int, device: int,
           levels: Sequence[Level]) -> list[tuple[int, int, tuple[int, ...]]]:
    group = math.prod(level.workers for level in levels[:k - 1])  # devices per level-(k-1) component
    placed: list[tuple[int, int, tuple[int, ...]]] = []
    for stage in stages:
        copies = [device + j * group for j in range(stage.replicas)]  # the first device of each replica
        if stage.inner:
            inner = [_place(stage.inner, k - 1, start, levels) for start in copies]
            placed += [(first, last, tuple(d for copy in inner for d in copy[i][2]))
                       for i, (first, last, _) in enumerate(inner[0])]
        else:
            placed.append((stage.first, stage.last, tuple(copies)))
        device += stage.replicas * group
    return placed


class _Sums:
    """Prefix sums so every range total is O(1)."""

    def __init__(self, values: Sequence[float]) -> None:
        self._prefix = [0.0, *accumulate(float(v) for v in values)]

    def __call__(self, first: int, last: int) -> float:
        return self._prefix[last + 1] - self._prefix[first]


def allreduce_time(weight_bytes: float, replicas: int, bandwidth: float, factor: float = ALLREDUCE_FACTOR) -> float:
    """Weight synchronisation of a stage on `replicas` workers (§2.4.1: (m-1)/m |w| each way)."""
    if replicas <= 1:
        return 0.0
    return factor * (replicas - 1) * weight_bytes / (replicas * bandwidth)


def replicated_stage_time(compute: float, weight_bytes: float, replicas: int, bandwidth: float,
                          factor: float = ALLREDUCE_FACTOR) -> float:
    """T^k(i->j, m): m inputs are processed at once while the all-reduce overlaps them, so the
    effective time per input is max(compute / m, all-reduce time)."""
    return max(compute / replicas, allreduce_time(weight_bytes, replicas, bandwidth, factor))


def stage_memory(resident: float, stash: float, replicas: int, downstream_workers: int) -> float:
    """Per-worker bytes of a stage: its weights once, plus one stash per in-flight input.

    Under 1F1B-RR a stage whose replicas are followed by `downstream_workers` workers (itself
    included) admits ceil(downstream_workers / replicas) inputs per replica, the NOAM rule of
    §2.4.2 applied to the sub-pipeline that starts at this stage.
    """
    return resident + math.ceil(downstream_workers / replicas) * stash


class _Solver:
    """Tables of the DP, level by level; memoised so lower levels are solved once per range."""

    def __init__(self, costs: LayerCosts, levels: tuple[Level, ...], memory: float | None, straight: bool) -> None:
        n = costs.n_layers
        self.costs, self.levels, self.memory, self.straight = costs, levels, memory, straight
        self.compute = _Sums(costs.compute)
        self.weights = _Sums(costs.param_bytes)
        self.stash = _Sums([0.0] * n if costs.stash_bytes is None else costs.stash_bytes)
        self.resident = _Sums(costs.param_bytes if costs.resident_bytes is None else costs.resident_bytes)
        self.cuts = [s for s in range(n - 1) if costs.can_cut_after(s)]
        # Memo tables of `exact` and `best`, held by the solver: functools.cache on a method keeps
        # every solver (and the costs it holds) alive in one class-wide cache for the whole process.
        self._exact: dict[tuple[int, int], dict[tuple[int, int], tuple[float, tuple[StageSpan, ...]]]] = {}
        self._best: dict[tuple[int, int, int], tuple[float, tuple[StageSpan, ...]]] = {}

    def stage_compute(self, k: int, first: int, last: int) -> tuple[float, tuple[StageSpan, ...]]:
        """A^{k-1}(first->last, m_{k-1}): compute time of one replica of a level-k stage."""
        if k == 1:
            return self.compute(first, last), ()
        return self.best(k - 1, first, last)

    def stage_time(self, k: int, first: int, last: int, replicas: int, downstream: int) -> float:
        """Time per input of a level-k stage, or INF when a level-1 stage overflows a device."""
        if k == 1 and self.memory is not None:
            need = stage_memory(self.resident(first, last), self.stash(first, last), replicas, downstream)
            if need > self.memory:
                return INF
        compute, _ = self.stage_compute(k, first, last)
        return replicated_stage_time(compute, self.weights(first, last), replicas, self.levels[k - 1].bandwidth)

    def transfer_time(self, k: int, last: int) -> float:
        """2 a_s / B_k: activations forward and their gradients backward across the cut."""
        return 2.0 * self.costs.activation_bytes[last] / self.levels[k - 1].bandwidth

    def max_replicas(self, m: int) -> int:
        return 1 if self.straight else m

    def exact(self, k: int, last: int) -> dict[tuple[int, int], tuple[float, tuple[StageSpan, ...]]]:
        """E^k(i->last, m) for every start i and *exact* worker count m at level k.

        The first stage of the range is [i, s] on r workers; the rest is an optimal
        sub-pipeline on m - r workers (the optimal sub-problem property, read from the front
        so that the first stage knows how many workers follow it, which fixes its stash).
        m = r with s = last is the single replicated stage the printed recurrence omits.
        """
        if (k, last) in self._exact:
            return self._exact[k, last]
        workers = self.levels[k - 1].workers
        table: dict[tuple[int, int], tuple[float, tuple[StageSpan, ...]]] = {}
        starts = [0] + [s + 1 for s in self.cuts]
        for first in reversed([i for i in starts if i <= last]):
            for m in range(1, workers + 1):
                table[first, m] = self._best_split(k, first, last, m, table)
        self._exact[k, last] = table
        return table

    def _best_split(self, k: int, first: int, last: int, m: int,
                    table: dict[tuple[int, int], tuple[float, tuple[StageSpan, ...]]]
                    ) -> tuple[float, tuple[StageSpan, ...]]:
        best: tuple[float, tuple[StageSpan, ...]] = (INF, ())
        if m <= self.max_replicas(m):
            best = (self.stage_time(k, first, last, m, m), (self._stage(k, first, last, m),))
        for s in (c for c in self.cuts if first <= c < last):
            cut = self.transfer_time(k, s)
            for r in range(1, min(m - 1, self.max_replicas(m)) + 1):
                rest_time, rest = table[s + 1, m - r]
                head = self.stage_time(k, first, s, r, m)
                time = max(head, cut, rest_time)
                if time < best[0]:
                    best = (time, (self._stage(k, first, s, r), *rest))
        return best

    def _stage(self, k: int, first: int, last: int, replicas: int) -> StageSpan:
        return StageSpan(first, last, replicas, self.stage_compute(k, first, last)[1])

    def with_replicas(self, replicas: Sequence[int]) -> tuple[float, tuple[StageSpan, ...]]:
        """The one-level split into len(replicas) stages, stage j on replicas[j] workers, with the
        least bottleneck: the DP's recurrence with the replication fixed instead of chosen."""
        last = self.costs.n_layers - 1

        @cache
        def best(first: int, j: int) -> tuple[float, tuple[StageSpan, ...]]:
            downstream = sum(replicas[j:])
            if j == len(replicas) - 1:
                return self.stage_time(1, first, last, replicas[j], downstream), (StageSpan(first, last, replicas[j]),)
            found: tuple[float, tuple[StageSpan, ...]] = (INF, ())
            for end in (c for c in self.cuts if first <= c < last):
                head = max(self.stage_time(1, first, end, replicas[j], downstream), self.transfer_time(1, end))
                rest_time, rest = best(end + 1, j + 1) if head < found[0] else (INF, ())
                if max(head, rest_time) < found[0]:
                    found = (max(head, rest_time), (StageSpan(first, end, replicas[j]), *rest))
            return found

        return best(0, 0)

    def balanced(self, bound: float, workers: int) -> tuple[StageSpan, ...] | None:
        """The straight one-level pipeline on exactly `workers` devices whose every stage and cut
        takes at most `bound` and whose stage times have the least sum of squares; None if none.

        The DP minimises the slowest stage only, so the others may be left anywhere below it
        (a GPT on 4 devices got stages of 102 and 261 ms below its bottleneck). Among the plans
        with that bottleneck this one spreads the rest most evenly: every stage keeps the most
        slack against a profile that is a little off."""
        last = self.costs.n_layers - 1
        limit = bound * (1 + 1e-9)

        @cache
        def best(first: int, m: int) -> tuple[float, tuple[int, ...]] | None:
            """(sum of squares, stage ends) for layers first..last on exactly m devices."""
            if m == 1:
                time = self.stage_time(1, first, last, 1, 1)
                return (time * time, (last,)) if time <= limit else None
            found = None
            for end in (c for c in self.cuts if first <= c < last):
                if self.compute(first, end) > limit:
                    break  # longer stages only take longer
                head = self.stage_time(1, first, end, 1, m)
                rest = best(end + 1, m - 1) if head <= limit and self.transfer_time(1, end) <= limit else None
                if rest is not None and (found is None or head * head + rest[0] < found[0]):
                    found = (head * head + rest[0], (end, *rest[1]))
            return found

        result = best(0, workers)
        if result is None:
            return None
        firsts = (0, *(end + 1 for end in result[1][:-1]))
        return tuple(StageSpan(a, b, 1) for a, b in zip(firsts, result[1], strict=True))

    def best(self, k: int, first: int, last: int) -> tuple[float, tuple[StageSpan, ...]]:
        """A^k(first->last, m_k): the best pipeline using *at most* m_k workers (ties: fewer)."""
        if (k, first, last) in self._best:
            return self._best[k, first, last]
        table = self.exact(k, last)
        best: tuple[float, tuple[StageSpan, ...]] = (INF, ())
        for m in range(1, self.levels[k - 1].workers + 1):
            candidate = table[first, m]
            if candidate[0] < best[0]:
                best = candidate
        self._best[k, first, last] = best
        return best


def plan_pipeline(costs: LayerCosts, topology: Topology, *, memory: float | None = None,
                  straight: bool = False) -> PipelinePlan:
    """A^L(0->N, m_L) and its partition: stages, replication factors, bottleneck time, over the
    topology's levels (`Topology.hierarchy`) of devices of `memory` bytes each (None: unlimited).

    `straight` forbids replication (one worker per stage), PipeDream's straight pipeline; on one
    level its stages are then also balanced below the bottleneck (`_Solver.balanced`).
    Raises NoFeasiblePlan when no partition fits the device memory.
    """
    levels = topology.hierarchy()
    solver = _Solver(costs, levels, memory, straight)
    time, stages = solver.best(len(levels), 0, costs.n_layers - 1)
    if time == INF:
        raise NoFeasiblePlan(_infeasible_reason(costs, topology, memory))
    if straight and len(levels) == 1:
        stages = solver.balanced(time, len(stages)) or stages
    return PipelinePlan(stages=stages, bottleneck=time, levels=levels)


def _infeasible_reason(costs: LayerCosts, topology: Topology, memory: float | None) -> str:
    resident = costs.param_bytes if costs.resident_bytes is None else costs.resident_bytes
    stash = [0.0] * costs.n_layers if costs.stash_bytes is None else costs.stash_bytes
    need = [r + s for r, s in zip(resident, stash, strict=True)]
    worst = max(range(costs.n_layers), key=need.__getitem__)
    where = f"{topology.n_devices} devices of {memory} bytes"
    if memory is not None and need[worst] > memory:
        return (f"layer {worst} alone needs {need[worst]} bytes (weights and one stash), more than one of "
                f"{where} holds. Use devices with more memory or a smaller microbatch.")
    return (f"no split of the {costs.n_layers} layers into contiguous stages fits on {where}: together "
            f"they need at least {sum(need)} bytes plus the stashes of in-flight inputs. Add devices or "
            "memory, allow more cut-points, or reduce the microbatch size.")


def plan_with_replicas(costs: LayerCosts, topology: Topology, replicas: Sequence[int], *,
                       memory: float | None = None) -> PipelinePlan:
    """Where to cut when the replication is given (`replicas[j]` devices run stage j, e.g. (2, 1)):
    the least bottleneck under the same model, over one level joined by the topology's slowest link.
    Raises NoFeasiblePlan when no such split fits the device memory (or there are too few cuts)."""
    if not replicas or any(r < 1 for r in replicas) or sum(replicas) > topology.n_devices:
        raise NoFeasiblePlan(f"replicas {tuple(replicas)} need {sum(replicas)} devices, there are {topology.n_devices}: "
                             "give every stage at least one replica, and fewer in all, or add devices")
    levels = (Level(sum(replicas), topology.slowest_link),)
    solver = _Solver(costs, levels, memory, straight=False)
    if len(solver.cuts) + 1 < len(replicas):
        raise NoFeasiblePlan(f"replicas {tuple(replicas)} asks for {len(replicas)} stages but the layers have only "
                             f"{len(solver.cuts)} legal cut-points: give at most {len(solver.cuts) + 1} counts")
    time, stages = solver.with_replicas(tuple(replicas))
    if time == INF:
        raise NoFeasiblePlan(_infeasible_reason(costs, topology, memory))
    return PipelinePlan(stages=stages, bottleneck=time, levels=levels)
