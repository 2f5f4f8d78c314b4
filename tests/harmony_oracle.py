"""Harmony's search as the paper states it, and the problem its packing approximates: test oracles.

The product runs Algorithm 1 restricted to one microbatch size and one packing for both passes
(passes/harmony_packing.py `search_configuration`, since our runtime runs no other). Here:

* `search_four_tuple`: Algorithm 1 unrestricted, sweeping U_F and U_B separately and packing the
  forward pass before the last backward pack (jit-compute), which shows what the restriction gives up.
* `estimate_iteration_time`: a compute-only estimate of a four-tuple's iteration (the task graph
  of §4.3.2 list-scheduled); the product scores with its event-driven simulator instead.
* `round_robin_makespan` and `optimal_packing`: the simplified scheduling problem of Appendix A
  (packs dealt round-robin to G GPUs, B microbatches), NP-hard (reduction from Partition), solved
  exactly by enumeration for small instances.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

from stagewise.ir.instructions import Phase
from stagewise.passes.harmony_packing import (
    BACKWARD,
    FORWARD,
    Configuration,
    CostModel,
    Packs,
    SearchResult,
    balanced_time_packing,
)
from stagewise.passes.pipedream_dp import NoFeasiblePlan


@dataclass(frozen=True)
class FunctionCosts:
    """A cost model from two callables (phase, microbatch, layer) -> seconds / bytes."""

    time_fn: Callable[[Phase, int, int], float]
    memory_fn: Callable[[Phase, int, int], float]

    def time(self, phase: Phase, microbatch: int, layer: int) -> float:
        return self.time_fn(phase, microbatch, layer)

    def memory(self, phase: Phase, microbatch: int, layer: int) -> float:
        return self.memory_fn(phase, microbatch, layer)


@dataclass(frozen=True)
class TableCosts:
    """Profiled tables: times[phase][u][layer] seconds and memories[phase][u][layer] bytes."""

    times: Mapping[Phase, Mapping[int, Sequence[float]]]
    memories: Mapping[Phase, Mapping[int, Sequence[float]]]

    def time(self, phase: Phase, microbatch: int, layer: int) -> float:
        return self.times[phase][microbatch][layer]

    def memory(self, phase: Phase, microbatch: int, layer: int) -> float:
        return self.memories[phase][microbatch][layer]


Estimator = Callable[[Configuration], float]


def search_four_tuple(n_layers: int, minibatch: int, costs: CostModel, capacity: float, *, gpus: int = 1,
                      mode: str = "pp", max_forward_microbatch: int | None = None,
                      max_backward_microbatch: int | None = None,
                      estimator: Estimator | None = None) -> SearchResult[float]:
    """Algorithm 1 unrestricted: the configuration with the least estimated iteration time.

    mode "pp" deals packs round-robin over the GPUs (Harmony PP); mode "dp" gives each GPU
    minibatch / gpus samples through every pack (Harmony DP, Alg. 1 lines 1-3). The default
    estimator is `estimate_iteration_time` (compute only).
    """
    if mode not in ("pp", "dp"):
        raise ValueError(f"mode must be 'pp' or 'dp', not {mode!r}")
    samples = math.ceil(minibatch / gpus) if mode == "dp" else minibatch
    u_f_max = min(max_forward_microbatch or samples, samples)
    u_b_max = min(max_backward_microbatch or samples, samples)
    if estimator is None:
        def estimator(config: Configuration) -> float:
            return estimate_iteration_time(config, costs, gpus=gpus, minibatch=minibatch, mode=mode)

    best: tuple[float, Configuration | None] = (math.inf, None)
    explored = 0
    for u_b in range(1, u_b_max + 1):
        backward = _try_pack(BACKWARD, u_b, costs, capacity, n_layers=n_layers)
        if backward is None:
            continue
        for u_f in range(1, u_f_max + 1):
            forward = _try_pack(FORWARD, u_f, costs, capacity, backward_packs=backward)
            if forward is None:
                continue
            config = Configuration(u_f, forward, u_b, backward)
            explored += 1
            time = estimator(config)
            if time < best[0]:
                best = (time, config)
    if best[1] is None:
        raise NoFeasiblePlan(f"no microbatch size from 1 to {u_b_max} lets every layer fit in {capacity:.4g} bytes")
    return SearchResult(best[1], best[0], explored)


def _try_pack(phase: Phase, microbatch: int, costs: CostModel, capacity: float, **layers) -> Packs | None:
    try:
        return balanced_time_packing(phase, microbatch, costs, capacity, **layers)
    except NoFeasiblePlan:
        return None


def estimate_iteration_time(config: Configuration, costs: CostModel, *, gpus: int, minibatch: int,
                            mode: str = "pp") -> float:
    """Compute-only iteration time of a configuration (the task graph of §4.3.2, simulated).

    Tasks follow the model: each forward pack at U_F, then the backward packs in reverse at
    U_B, where a backward task recomputes its pack's forward (or, for the last pack, runs it
    for the first time: jit-compute) before its backward. A group of samples starts once
    its GPU is free and the samples it needs have left the previous task.
    """
    samples = math.ceil(minibatch / gpus) if mode == "dp" else minibatch
    tasks = [_groups(samples, config.forward_microbatch,
                     lambda u, pack=pack: sum(costs.time(FORWARD, u, i) for i in pack))
             for pack in config.forward_packs]
    tasks += [_groups(samples, config.backward_microbatch,
                      lambda u, pack=pack: sum(costs.time(FORWARD, u, i) + costs.time(BACKWARD, u, i)
                                               for i in pack))
              for pack in reversed(config.backward_packs)]
    lanes = 1 if mode == "dp" else gpus
    return simulate_tasks(tasks, [j % lanes for j in range(len(tasks))], lanes)


Group = tuple[int, int, float]  # samples [start, stop) and seconds


def _groups(samples: int, microbatch: int, seconds: Callable[[int], float]) -> list[Group]:
    return [(lo, min(lo + microbatch, samples), seconds(min(microbatch, samples - lo)))
            for lo in range(0, samples, microbatch)]


def simulate_tasks(tasks: Sequence[Sequence[Group]], gpu_of: Sequence[int], gpus: int) -> float:
    """List-schedule tasks in order: each GPU runs its groups in turn; a group waits for the
    groups of the previous task that hold any of its samples. Returns the makespan."""
    free = [0.0] * gpus
    previous: list[tuple[int, int, float]] = []  # (start, stop, finish) of the previous task
    for groups, gpu in zip(tasks, gpu_of, strict=True):
        finished = []
        for lo, hi, seconds in groups:
            ready = max((end for a, b, end in previous if a < hi and b > lo), default=0.0)
            start = max(free[gpu], ready)
            free[gpu] = start + seconds
            finished.append((lo, hi, free[gpu]))
        previous = finished
    return max(free)


def round_robin_makespan(pack_times: Sequence[float], gpus: int, microbatches: int) -> float:
    """Makespan of Definition A.1: pack j on GPU j mod G, each of B microbatches in order."""
    tasks = [[(b, b + 1, t) for b in range(microbatches)] for t in pack_times]
    return simulate_tasks(tasks, [j % gpus for j in range(len(tasks))], gpus)


def contiguous_packings(sizes: Sequence[float], capacity: float) -> Iterator[Packs]:
    """Every split of the layers into contiguous packs whose sizes fit `capacity`."""

    def extend(first: int) -> Iterator[tuple[range, ...]]:
        if first == len(sizes):
            yield ()
            return
        total = 0.0
        for stop in range(first + 1, len(sizes) + 1):
            total += sizes[stop - 1]
            if total > capacity:
                return
            for rest in extend(stop):
                yield (range(first, stop), *rest)

    yield from extend(0)


def optimal_packing(times: Sequence[float], sizes: Sequence[float], capacity: float, gpus: int,
                    microbatches: int, *, limit: int = 200_000) -> tuple[Packs, float]:
    """The exact optimum of Appendix A's scheduling problem by enumeration (small instances).

    The problem is NP-hard (Proposition A.2); this raises ValueError after `limit` packings
    rather than run for ever.
    """
    best: tuple[Packs, float] = ((), math.inf)
    for count, packs in enumerate(contiguous_packings(sizes, capacity)):
        if count >= limit:
            raise ValueError(f"more than {limit} feasible packings; use balanced_time_packing instead")
        makespan = round_robin_makespan([sum(times[i] for i in pack) for pack in packs], gpus, microbatches)
        if makespan < best[1]:
            best = (packs, makespan)
    if not best[0]:
        raise NoFeasiblePlan(f"some layer is larger than the {capacity} bytes a pack may hold")
    return best
