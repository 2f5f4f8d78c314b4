"""Stage costs from a plan alone: FLOPs recorded in the plan over a device's peak rate.

For `pipe.simulate(peak_flops=...)` on hardware one does not have, and for a loaded pipeline,
which keeps no per-layer profile: forward seconds are the stage's forward FLOPs
(torch.utils.flop_counter on fake tensors, per microbatch) over the device's peak FLOP/s
times its relative speed; backward is twice the forward (the usual 2x for matmul-bound
layers, Narayanan §4.2); state is parameters plus gradients; the stash counted is the
activations a stage receives and sends per microbatch (a lower bound: interior activations
are not tracked yet).
"""

from __future__ import annotations

from stagewise.ir.plan import Plan
from stagewise.passes.analytic import DEFAULT_PEAK_FLOPS
from stagewise.passes.simulate import SimCost, transfer_bytes

CPU_PEAK_FLOPS = DEFAULT_PEAK_FLOPS["cpu"]
LOCAL_BANDWIDTH = 1e10  # bytes/s of a copy between logical devices in one process


def analytic_cost(plan: Plan, peak_flops: float = CPU_PEAK_FLOPS, bandwidth: float = LOCAL_BANDWIDTH) -> SimCost:
    forward, params, stash = [], [], []
    values = transfer_bytes(plan.transfers, plan.microbatch_size)
    for stage in plan.stages:
        speed = plan.devices[stage.device].speed
        flops = sum(plan.layers[i].flops for i in stage.layers)
        forward.append(flops / (peak_flops * speed))
        params.append(sum(plan.layers[i].param_bytes for i in stage.layers))
        moved = {t.value for t in plan.transfers if stage.index in (t.src, t.dst)}
        stash.append(sum(values[v] for v in moved))
    return SimCost(
        forward_s=tuple(forward),
        backward_s=tuple(2 * f for f in forward),
        stash_bytes=tuple(stash),
        state_bytes=tuple(2 * p for p in params),
        value_bytes=values,
        bandwidth=bandwidth,
    )
