"""The planner's use of PipeDream's DP (passes/pipedream_dp.py, dissertation §2.4.1): the per-layer
profile it reads, the straight pipeline of the gpipe / 1f1b / varuna candidates, and plans whose
stages are replicated each their own number of ways (a "2-1" plan: stage 0 on two devices, stage 1
on one), which the DP chooses over the topology's levels or places for a replication given.

The DP assumes equal devices (PipeDream's setting); the planner scores its plans with the
simulator on the real devices like every other candidate, so a replicated plan is kept only
where the simulator, charging the replicas' gradient all-reduce, predicts it faster.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from stagewise.ir.choices import Schedule
from stagewise.ir.errors import PartitionError
from stagewise.ir.plan import Cut, DeviceSpec, Layer, LayerCost
from stagewise.ir.topology import Topology
from stagewise.passes.layout import Layout
from stagewise.passes.partition import balanced_starts
from stagewise.passes.pipedream_dp import LayerCosts, NoFeasiblePlan, plan_pipeline, plan_with_replicas
from stagewise.passes.schedule import REPLICATED_STAGE_SCHEDULES

DP_MAX_LAYERS = 256  # beyond, the O(L^2 P) DP costs seconds: a bottleneck search (O(L log)) instead


@dataclass(frozen=True)
class ReplicatedStages:
    """Where a plan with replicated stages cuts and what runs each stage: `devices[s]` are the
    devices of stage s's replicas; `bottleneck_s` the DP's time per microbatch (its slowest stage
    or cut, PipeDream's objective)."""

    starts: tuple[int, ...]
    devices: tuple[tuple[int, ...], ...]
    bottleneck_s: float


def dp_layer_costs(cuts: Sequence[Cut], costs: Sequence[LayerCost], microbatch_size: int) -> LayerCosts:
    """The profile the DP reads (§2.4.1 "Profiler") from the planner's layer costs at one size."""
    return LayerCosts(
        compute=[c.fwd_s + c.bwd_s for c in costs],
        activation_bytes=[cut.bytes_per_sample * microbatch_size for cut in cuts] + [0.0],
        param_bytes=[c.grad_bytes for c in costs],  # what replicas all-reduce: trainable parameters' gradients
        stash_bytes=[c.stash_bytes for c in costs],
        resident_bytes=[c.state_bytes for c in costs],
        cut_allowed=[c.legal for c in cuts],
    )


def straight_partition(layers: tuple[Layer, ...], cuts: tuple[Cut, ...], costs: Sequence[LayerCost], layout: Layout,
                       devices: Sequence[DeviceSpec], microbatch_size: int,
                       topology: Topology) -> tuple[list[int], list[int]]:
    """Stage starts and devices of the first pipeline of `layout`: the DP's straight pipeline over
    the links (and levels) of those devices; a bottleneck search beyond DP_MAX_LAYERS, and where
    nothing fits the memory (memory is then the swap planner's business)."""
    positions = layout.positions
    at = [layout.device_of(s, 0) for s in range(positions)]  # the devices of the first pipeline
    if len(layers) > DP_MAX_LAYERS:
        starts = balanced_starts(layers, cuts, positions, [c.fwd_s + c.bwd_s for c in costs])
        return starts, at[:len(starts)]
    try:
        # the DP plans over the links (and levels) of those devices, renumbered in pipeline order
        plan = plan_pipeline(dp_layer_costs(cuts, costs, microbatch_size), topology.among(at),
                             memory=_capacity(devices), straight=True)
    except NoFeasiblePlan:
        starts = balanced_starts(layers, cuts, positions)
        return starts, at[:len(starts)]
    placed = plan.placed_stages()  # fewer stages than positions leave the last devices idle
    return [first for first, _, _ in placed], [at[device] for _, _, device in placed]


def replicated_partition(schedule: Schedule, layers: tuple[Layer, ...], cuts: tuple[Cut, ...], costs: Sequence[LayerCost],
                         devices: Sequence[DeviceSpec], microbatch_size: int, topology: Topology,
                         replicas: tuple[int, ...] = ()) -> ReplicatedStages:
    """PipeDream's DP over every device and the topology's levels, choosing each stage's
    replication (`replicas` empty), or cutting for the replication given (`replicas[s]` devices
    for stage s, on consecutive devices). Raises PartitionError where it cannot run."""
    check_replicated_schedule(schedule)
    if len(layers) > DP_MAX_LAYERS:
        raise PartitionError(f"replicated stages are planned by PipeDream's DP, which takes at most {DP_MAX_LAYERS} "
                             f"layers; this model has {len(layers)}. Replicate whole pipelines (replicas=D) instead")
    profile = dp_layer_costs(cuts, costs, microbatch_size)
    if replicas:
        plan = plan_with_replicas(profile, topology, replicas, memory=_capacity(devices))
    else:
        plan = plan_pipeline(profile, topology, memory=_capacity(devices))
    placed = plan.replica_devices()
    return ReplicatedStages(tuple(first for first, _, _ in placed), tuple(on for _, _, on in placed), plan.bottleneck)


def consecutive_devices(replicas: Sequence[int], n_devices: int) -> tuple[tuple[int, ...], ...]:
    """Stage s on the next replicas[s] devices (replicas given with the split points)."""
    if sum(replicas) > n_devices:
        raise PartitionError(f"replicas {tuple(replicas)} need {sum(replicas)} devices, there are {n_devices}: "
                             "give the stages fewer replicas, or add devices")
    firsts = [sum(replicas[:s]) for s in range(len(replicas))]
    return tuple(tuple(range(first, first + r)) for first, r in zip(firsts, replicas, strict=True))


def check_replicated_schedule(schedule: Schedule) -> None:
    if schedule not in REPLICATED_STAGE_SCHEDULES:
        raise PartitionError(f"{schedule} cannot run stages replicated each their own number of ways; use "
                             f"schedule={' or '.join(repr(str(s)) for s in REPLICATED_STAGE_SCHEDULES)} with per-stage replicas")


def _capacity(devices: Sequence[DeviceSpec]) -> int | None:
    """The memory the DP checks each stage against: the smallest device's (None: unlimited)."""
    return min((d.memory for d in devices if d.memory), default=None)
