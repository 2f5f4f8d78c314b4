"""Harmony's layer packs: balanced time packing (Alg. 2) and the configuration search (Alg. 1), §4.3.1.

Harmony runs a model that does not fit in GPU memory as *layer packs*: contiguous runs of
layers that are swapped in and executed as one task. Packing greedily as large as memory
allows gives "globally sub-optimal pipelines" (Fig. 8): packs of unequal time leave GPUs idle.

* `balanced_time_packing` is Algorithm 2: for the fewest packs S that memory permits upward,
  cut the prefix sums of per-layer time at multiples of the average pack time, and return the
  first packing whose every pack fits.
* `search_configuration` is Algorithm 1 as our runtime can run it. The paper searches a
  four-tuple (U_F, P_F, U_B, P_B): forward and backward microbatch sizes and packs chosen apart.
  Our runtime runs one microbatch size per step and one packing for both passes (a stage is one
  pack for its forwards and its backwards), so the search is restricted to U_F = U_B and
  P_F = P_B: it sweeps U, packs the backward pass with Alg. 2 (Alg. 1 line 7) and runs those
  packs forward too, skipping line 9's forward packing. The paper measures this "Equi-FB"
  1.7-29.1% slower than distinct configurations (Appendix, Table 5). And the runtime splits a
  minibatch into equal microbatches, so U sweeps the sizes that divide it (the paper's 1 to U_MAX
  leaves a smaller last group where U does not divide D). Each configuration is scored
  by the caller's estimator; the paper's is its event-driven simulator over the task graph
  (§4.3.1, Fig. 15), and the planner passes ours (passes/harmony_search.py).

The unrestricted four-tuple search, a compute-only estimator and Appendix A's exact packing are
test oracles (tests/harmony_oracle.py). Per-layer costs are a `CostModel` of (phase, microbatch
size, layer), the profile phi of Alg. 1.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import accumulate
from typing import Generic, Protocol, TypeVar

from stagewise.ir.instructions import Phase
from stagewise.passes.pipedream_dp import NoFeasiblePlan

FORWARD, BACKWARD = Phase.FORWARD, Phase.BACKWARD


class CostModel(Protocol):
    """Per-layer cost of one phase at microbatch size u (the profile phi of Alg. 1)."""

    def time(self, phase: Phase, microbatch: int, layer: int) -> float: ...

    def memory(self, phase: Phase, microbatch: int, layer: int) -> float: ...


Packs = tuple[range, ...]


def balanced_time_packing(phase: Phase, microbatch: int, costs: CostModel, capacity: float, *,
                          n_layers: int | None = None, backward_packs: Sequence[range] | None = None,
                          fewest: int = 1) -> Packs:
    """Algorithm 2: packs of nearly equal time, as few (as large) as memory allows.

    Give `n_layers` for the backward pass, or `backward_packs` for the forward pass, whose
    packs then cover only the layers before the last backward pack (jit-compute, Alg. 2 line 2;
    only the unrestricted search packs a forward pass). `fewest`: a floor on S above line 5's
    S_min = sum(memory) / capacity, for a runtime that wants a number of packs whatever the memory.
    Raises NoFeasiblePlan when a single layer exceeds `capacity`.
    """
    layers = backward_packs[-1].start if backward_packs is not None else n_layers
    if layers is None:
        raise ValueError("balanced_time_packing needs n_layers or backward_packs")
    if layers == 0:
        return ()
    times = [costs.time(phase, microbatch, layer) for layer in range(layers)]
    memory = [costs.memory(phase, microbatch, layer) for layer in range(layers)]
    smallest = math.ceil(sum(memory) / capacity) if capacity > 0 else layers
    for count in range(min(max(1, fewest, smallest), layers), layers + 1):
        packs = split_balanced(times, count)
        if all(sum(memory[i] for i in pack) <= capacity for pack in packs):
            return packs
    worst = max(range(layers), key=memory.__getitem__)
    raise NoFeasiblePlan(
        f"layer {worst} needs {memory[worst]:.4g} bytes in the {phase.name.lower()} pass at microbatch size "
        f"{microbatch}, more than the {capacity:.4g} bytes a pack may use; lower the microbatch size or add memory."
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


Score = TypeVar("Score", float, tuple)  # what an estimator returns: lower is better


@dataclass(frozen=True)
class SearchResult(Generic[Score]):
    config: Configuration
    time: Score  # the estimator's score of `config`
    explored: int


class Packing(Protocol):
    """Alg. 1's "adopted packing method" (its input): `balanced_time_packing` or one built on it."""

    def __call__(self, phase: Phase, microbatch: int, costs: CostModel, capacity: float, *, n_layers: int,
                 fewest: int) -> Packs: ...


def search_configuration(n_layers: int, microbatch_sizes: Sequence[int], costs: CostModel, capacity: float,
                         estimator: Callable[[Configuration], Score], *, fewest: int = 1,
                         packing: Packing = balanced_time_packing) -> SearchResult[Score]:
    """Algorithm 1 restricted to U_F = U_B and P_F = P_B (see the module docstring): the configuration
    the estimator scores lowest.

    `microbatch_sizes` are the U the runtime can run (the paper sweeps 1 to U_MAX, line 6; Harmony
    DP's U_MAX is the samples per GPU, lines 1-3). A size at which some layer exceeds `capacity` is
    skipped; NoFeasiblePlan when every size is. `fewest`: Alg. 2's floor on the number of packs.
    """
    best: tuple[Score, Configuration] | None = None
    explored = 0
    for size in microbatch_sizes:
        try:
            packs = packing(BACKWARD, size, costs, capacity, n_layers=n_layers, fewest=fewest)
        except NoFeasiblePlan:
            continue
        config = Configuration(size, packs, size, packs)
        explored += 1
        score = estimator(config)
        if best is None or score < best[0]:
            best = (score, config)
    if best is None:
        sizes = ", ".join(map(str, microbatch_sizes))
        raise NoFeasiblePlan(f"at no microbatch size ({sizes}) does every layer fit in the {capacity:.4g} bytes of "
                             "a device; give the devices more memory, or make the model's blocks finer-grained")
    return SearchResult(best[1], best[0], explored)
