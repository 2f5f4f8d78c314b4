"""What the simulator charges a plan: per-stage seconds and bytes from per-layer costs, the links of
the topology, and what the runtime adds.

One function, `stage_charges`, serves the planner's candidates (passes/planner.py `sim_cost`) and
`pipe.simulate()` (`plan_charges`), which reads the costs the plan records (`Plan.costs`: the
per-layer costs, profiled or analytic, at the plan's microbatch size, the measured links and the
runtime's costs), so that a loaded pipeline predicts exactly what compile predicted.

For hardware one does not have, `plan_charges` takes a peak FLOP rate: each layer then costs the
analytic model's compute bound at that rate (passes/analytic.py `compute_bound`; the plan records
each layer's FLOPs but not the bytes it moves), and this machine's runtime costs are dropped; or
a bandwidth: every link between the devices has it (swaps still cross each device's host link).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import replace

from stagewise.ir.costs import NO_RUNTIME_COSTS, RuntimeCosts
from stagewise.ir.errors import PlanError
from stagewise.ir.plan import DeviceSpec, LayerCost, Plan, SharedTensor, Stage, Transfer
from stagewise.ir.topology import Topology
from stagewise.passes.analytic import compute_bound
from stagewise.passes.simulate import SimCost, transfer_bytes


def stage_charges(stages: Sequence[Stage], transfers: Sequence[Transfer], swapped: Collection[int],
                  costs: Sequence[LayerCost], devices: Sequence[DeviceSpec], microbatch_size: int,
                  topology: Topology, runtime: RuntimeCosts = NO_RUNTIME_COSTS,
                  shared: Sequence[SharedTensor] = (), weight_versions: int = 1) -> SimCost:
    """Per-stage seconds and bytes from per-layer costs (measured or analytic), scaled by device speed;
    the topology's links between the devices; the bytes of each `shared` tensor whose gradient is
    all-reduced (tied weights, replicated stages); and what the runtime adds. A `swapped` stage's
    training state lives in host memory: its swaps charge it, not its device. `weight_versions`:
    copies of each trained weight a stage holds (2 under 2BW: Schedule.weight_versions)."""
    forward, backward, update, split, stash, state = [], [], [], [], [], []
    for stage in sorted(stages, key=lambda s: s.index):
        speed = devices[stage.device].speed
        mine = [costs[i] for i in stage.layers]
        forward.append(sum(c.fwd_s for c in mine) / speed)
        backward.append(sum(c.bwd_s for c in mine) / speed)
        versions = (weight_versions - 1) * sum(c.grad_bytes for c in mine)  # trained weights' further copies
        update.append(sum(runtime.update_s[i] for i in stage.layers if i < len(runtime.update_s)) / speed
                      + _version_copy_s(versions, devices[stage.device], topology.host_link(stage.device)))
        split.append(sum(runtime.split_backward_s[i] for i in stage.layers if i < len(runtime.split_backward_s)) / speed)
        stash.append(sum(c.stash_bytes for c in mine) + _outputs_kept(stage, transfers, microbatch_size))
        state.append(0 if stage.index in swapped else sum(c.state_bytes for c in mine) + versions)
    shares = input_grad_shares(stages, transfers)
    # a split backward's B records the gradients at the weights' layers for W: about an activation per
    # layer, estimated as the stage's stash (measured on bench/zero_bubble.py's GPT: 9.0 of a 13.5 MiB stash)
    recorded = tuple(b if share else 0.0 for b, share in zip(stash, shares, strict=True))
    return SimCost(
        forward_s=tuple(forward), backward_s=tuple(backward), update_s=tuple(update), stash_bytes=tuple(stash),
        input_grad_share=shares, recorded_bytes=recorded, split_backward_s=tuple(split),
        state_bytes=tuple(state), value_bytes=transfer_bytes(transfers, microbatch_size),
        tensor_bytes={t.fqn: float(t.nbytes) for t in shared if t.summed},
        bandwidth=topology.slowest_link, links=topology.links(),
        # a swap crosses its device's host link, shared with the devices of that host
        host_links={d: topology.host_link(d) for d in range(topology.n_devices)},
        hosts={d: topology.host_of(d) for d in range(topology.n_devices)},
        instruction_s=runtime.instruction_s, concurrency=runtime.concurrency,
        wake_s=runtime.wake_s, update_concurrency=runtime.update_concurrency,
        shared_devices=frozenset(d for d, spec in enumerate(devices) if spec.kind == "cpu"),
    )


def _version_copy_s(nbytes: float, device: DeviceSpec, host_link: float) -> float:
    """What 2bw's further weight versions add to an update (runtime/weight_versions.py): their copy in
    the device's memory (at its bandwidth where known, else the host link's: a CPU device's copy) and
    in the undo record, over the host link like the rest of it (compiler/compile/costing.py)."""
    if not nbytes:
        return 0.0
    return nbytes / (device.memory_bandwidth or host_link) + nbytes / host_link


def _outputs_kept(stage: Stage, transfers: Sequence[Transfer], microbatch_size: int) -> float:
    """Bytes per microbatch of the values `stage` computes and sends on: the runtime keeps its outputs
    from the forward to the backward (runtime/stash.py `add_outputs`), and no op of the stage saved
    them (a stage ends at a residual add), so the layers' stashes do not count them."""
    sent = {t.value: t.bytes_per_sample for t in transfers if t.src == stage.index}
    return sum(sent.values()) * microbatch_size


def input_grad_shares(stages: Sequence[Stage], transfers: Sequence[Transfer]) -> tuple[float, ...]:
    """Per stage, the share of its backward a split backward's input gradient (B) takes: none for a
    stage no gradient leaves (the first: W does the whole backward), else half (B and W each one
    matmul per forward matmul, Qi et al. §2; not measured apart)."""
    sends_grads = {t.dst for t in transfers if t.requires_grad}
    return tuple(0.5 if s.index in sends_grads else 0.0 for s in sorted(stages, key=lambda s: s.index))


def plan_charges(plan: Plan, peak_flops: float | None = None, bandwidth: float | None = None) -> SimCost:
    """What the simulator charges `plan`: the costs its predictions charged, or, with `peak_flops`,
    each layer's FLOPs at that rate (times each device's relative speed) without this machine's
    runtime costs; with `bandwidth`, that many bytes/s on every link between devices (swaps keep
    the plan's host links)."""
    recorded = plan.costs
    if recorded is None:
        raise PlanError("this plan records no costs to simulate it with (a plan saved before plans kept "
                        "their costs): compile the model again, and save the new pipeline")
    layers, runtime, topology = recorded.layers, recorded.runtime, recorded.topology
    if peak_flops is not None:
        layers = tuple(compute_bound(cost, layer.flops, peak_flops)
                       for cost, layer in zip(layers, plan.layers, strict=True))
        runtime = NO_RUNTIME_COSTS
    if bandwidth is not None:
        topology = replace(Topology.uniform(len(plan.devices), bandwidth), host_links=topology.host_links,
                           hosts=tuple(topology.host_of(d) for d in range(topology.n_devices)))
    return stage_charges(plan.stages, plan.transfers, recorded.swapped, layers, plan.devices, plan.microbatch_size,
                         topology, runtime, plan.shared, plan.schedule.weight_versions)
