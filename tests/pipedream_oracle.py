"""PipeDream's cost model (dissertation §2.4.1) applied to a plan given whole: the test oracle that
checks the DP's plans take the time it reports. The product only ever times the plans the DP makes
(passes/pipedream_dp.py), so scoring an arbitrary plan lives here."""

from __future__ import annotations

import math
from collections.abc import Sequence

from stagewise.ir.topology import Level, Topology
from stagewise.passes.pipedream_dp import LayerCosts, StageSpan, replicated_stage_time, stage_memory


def bottleneck_time(plan: Sequence[StageSpan], costs: LayerCosts, topology: Topology, *,
                    memory: float | None = None) -> float:
    """Time of the slowest stage or cut of `plan` under the DP's model (math.inf: it does not fit)."""
    _check_cover(plan, 0, costs.n_layers - 1, costs)
    levels = topology.hierarchy()
    return _pipeline_time(plan, costs, levels, len(levels), memory)


def _check_cover(stages: Sequence[StageSpan], first: int, last: int, costs: LayerCosts) -> None:
    """A plan's stages must tile first..last in order, cut only where cuts are allowed."""
    position = first
    for stage in stages:
        if stage.first != position or stage.last < stage.first or stage.replicas < 1:
            raise ValueError(f"stages {stages} do not tile layers {first}..{last} in order")
        if stage.last < last and not costs.can_cut_after(stage.last):
            raise ValueError(f"stage {stage} ends after layer {stage.last}, where no cut is allowed")
        if stage.inner:
            _check_cover(stage.inner, stage.first, stage.last, costs)
        position = stage.last + 1
    if position != last + 1:
        raise ValueError(f"stages {stages} do not tile layers {first}..{last}")


def _pipeline_time(stages: Sequence[StageSpan], costs: LayerCosts, levels: Sequence[Level], k: int,
                   memory: float | None) -> float:
    level = levels[k - 1]
    downstream = sum(stage.replicas for stage in stages)
    if downstream > level.workers:
        return math.inf
    time = 0.0
    for index, stage in enumerate(stages):
        layers = range(stage.first, stage.last + 1)
        if k == 1:
            resident = costs.param_bytes if costs.resident_bytes is None else costs.resident_bytes
            stash = [0.0] * costs.n_layers if costs.stash_bytes is None else costs.stash_bytes
            need = stage_memory(sum(resident[i] for i in layers), sum(stash[i] for i in layers), stage.replicas,
                                downstream)
            if memory is not None and need > memory:
                return math.inf
            compute = sum(costs.compute[i] for i in layers)
        else:
            compute = _pipeline_time(stage.inner, costs, levels, k - 1, memory)
        weights = sum(costs.param_bytes[i] for i in layers)
        time = max(time, replicated_stage_time(compute, weights, stage.replicas, level.bandwidth))
        if index + 1 < len(stages):
            time = max(time, 2.0 * costs.activation_bytes[stage.last] / level.bandwidth)
        downstream -= stage.replicas
    return time
