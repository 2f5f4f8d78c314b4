"""Harmony's layer packs: balanced time packing and the four-tuple search (Harmony, §4.3.1).

Harmony runs a model that does not fit in GPU memory as *layer packs*: contiguous runs of
layers that are swapped in and executed as one task. Packing greedily as large as memory
allows gives "globally sub-optimal pipelines" (Fig. 8): packs of unequal time leave GPUs idle.
And forward and backward passes differ (a backward is often 2-3x the time and memory of the
forward), so Harmony picks a four-tuple configuration: forward microbatch size U_F, forward
packs P_F, backward microbatch size U_B, backward packs P_B.

* `balanced_time_packing` is Algorithm 2: for the fewest packs S that memory permits upward,
  cut the prefix sums of per-layer time at multiples of the average pack time, and return the
  first packing whose every pack fits. Forward packs stop before the last backward pack:
  that pack runs its forward right before its backward at U_B ("jit-compute", Alg. 2 line 2),
  so its stash is never recomputed.
* `search_configuration` is Algorithm 1: sweep U_B, pack the backward pass, sweep U_F, pack
  the forward pass, estimate each configuration's iteration time, keep the best.
* `round_robin_makespan` and `optimal_packing` are the simplified scheduling problem of
  Appendix A (packs dealt round-robin to G GPUs, B microbatches), whose exact optimum is
  NP-hard (reduction from Partition); `optimal_packing` enumerates for small instances.

Per-layer costs are a `CostModel` of (phase, microbatch size, layer), so profiled tables and
analytic formulas plug in the same way.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from itertools import accumulate
from typing import Protocol

from stagewise.passes.pipedream_dp import NoFeasiblePlan

FORWARD, BACKWARD = "F", "B"


class CostModel(Protocol):
    """Per-layer cost of one phase ("F" or "B") at microbatch size u (the profile phi of Alg. 1)."""

    def time(self, phase: str, microbatch: int, layer: int) -> float: ...

    def memory(self, phase: str, microbatch: int, layer: int) -> float: ...


@dataclass(frozen=True)
class FunctionCosts:
    """A cost model from two callables (phase, microbatch, layer) -> seconds / bytes."""

    time_fn: Callable[[str, int, int], float]
    memory_fn: Callable[[str, int, int], float]

    def time(self, phase: str, microbatch: int, layer: int) -> float:
        return self.time_fn(phase, microbatch, layer)

    def memory(self, phase: str, microbatch: int, layer: int) -> float:
        return self.memory_fn(phase, microbatch, layer)


@dataclass(frozen=True)
class TableCosts:
    """Profiled tables: times[phase][u][layer] seconds and memories[phase][u][layer] bytes."""

    times: Mapping[str, Mapping[int, Sequence[float]]]
    memories: Mapping[str, Mapping[int, Sequence[float]]]

    def time(self, phase: str, microbatch: int, layer: int) -> float:
        return self.times[phase][microbatch][layer]

    def memory(self, phase: str, microbatch: int, layer: int) -> float:
        return self.memories[phase][microbatch][layer]


Packs = tuple[range, ...]


def balanced_time_packing(phase: str, microbatch: int, costs: CostModel, capacity: float, *,
                          n_layers: int | None = None, backward_packs: Sequence[range] | None = None) -> Packs:
    """Algorithm 2: packs of nearly equal time, as few (as large) as memory allows.

    Give `n_layers` for the backward pass, or `backward_packs` for the forward pass, whose
    packs then cover only the layers before the last backward pack (jit-compute).
    Raises NoFeasiblePlan when a single layer exceeds `capacity`.
    """
    layers = backward_packs[-1].start if backward_packs is not None else n_layers
    if layers is None:
        raise ValueError("balanced_time_packing needs n_layers or backward_packs")
    if layers == 0:
        return ()
    times = [costs.time(phase, microbatch, layer) for layer in range(layers)]
    memory = [costs.memory(phase, microbatch, layer) for layer in range(layers)]
    fewest = max(1, math.ceil(sum(memory) / capacity)) if capacity > 0 else layers
    for count in range(fewest, layers + 1):
        packs = split_balanced(times, count)
        if all(sum(memory[i] for i in pack) <= capacity for pack in packs):
            return packs
    worst = max(range(layers), key=memory.__getitem__)
    raise NoFeasiblePlan(
        f"layer {worst} needs {memory[worst]:.4g} bytes in phase {phase} at microbatch {microbatch}, "
        f"more than the {capacity:.4g} bytes a pack may use; lower the microbatch size or add memory."
    )


def split_balanced(times: Sequence[float], count: int) -> Packs:
    """Cut the prefix sums of layer times at c, 2c, ..., (S-1)c with c = total / S (Alg. 2 l. 7-11).

    Each cut goes to the layer edge nearest its target (the insertion point found by binary
    search, or the edge before it when that is closer), and no pack is left empty.
    """
    n = len(times)
    if not 1 <= count <= n:
        raise ValueError(f"cannot split {n} layers into {count} non-empty packs")
    prefix = list(accumulate(times))  # prefix[i]: time of layers 0..i
    edges, low = [0], 1
    for k in range(1, count):
        target = k * prefix[-1] / count
        i = bisect_left(prefix, target)  # first layer whose running time reaches target
        edge = i if i > 0 and target - prefix[i - 1] <= prefix[min(i, n - 1)] - target else i + 1
        edge = min(max(edge, low), n - (count - k))
        edges.append(edge)
        low = edge + 1
    edges.append(n)
    return tuple(range(a, b) for a, b in zip(edges, edges[1:], strict=False))


@dataclass(frozen=True)
class Configuration:
    """Harmony's four-tuple (U_F, P_F, U_B, P_B); the last backward pack is jit-computed."""

    forward_microbatch: int
    forward_packs: Packs
    backward_microbatch: int
    backward_packs: Packs


@dataclass(frozen=True)
class SearchResult:
    config: Configuration
    time: float
    explored: int


Estimator = Callable[[Configuration], float]
Packer = Callable[..., Packs]


def search_configuration(n_layers: int, minibatch: int, costs: CostModel, capacity: float, *,
                         gpus: int = 1, mode: str = "pp", max_forward_microbatch: int | None = None,
                         max_backward_microbatch: int | None = None, estimator: Estimator | None = None,
                         packer: Packer = balanced_time_packing) -> SearchResult:
    """Algorithm 1: the configuration with the least estimated iteration time.

    mode "pp" deals packs round-robin over the GPUs (Harmony PP); mode "dp" gives each GPU
    minibatch / gpus samples through every pack (Harmony DP, Alg. 1 lines 1-3). The default
    estimator is `estimate_iteration_time` (compute only); pass the simulator to count swaps.
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
        backward = _try_pack(packer, BACKWARD, u_b, costs, capacity, n_layers=n_layers)
        if backward is None:
            continue
        for u_f in range(1, u_f_max + 1):
            forward = _try_pack(packer, FORWARD, u_f, costs, capacity, backward_packs=backward)
            if forward is None:
                continue
            config = Configuration(u_f, forward, u_b, backward)
            explored += 1
            time = estimator(config)
            if time < best[0]:
                best = (time, config)
    if best[1] is None:
        raise NoFeasiblePlan(f"no microbatch size from 1 to {u_b_max} lets every layer fit in "
                             f"{capacity:.4g} bytes; add memory or use finer layers.")
    return SearchResult(best[1], best[0], explored)


def _try_pack(packer: Packer, phase: str, microbatch: int, costs: CostModel, capacity: float,
              **layers: object) -> Packs | None:
    try:
        return tuple(packer(phase, microbatch, costs, capacity, **layers))
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

    The problem is NP-hard (Proposition A.2), so this is for tests and tiny models; it raises
    ValueError after `limit` packings rather than run for ever.
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
