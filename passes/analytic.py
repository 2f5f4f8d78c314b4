"""Per-layer costs from the trace and a device's datasheet figures (cost="analytic").

For hardware one does not have, nothing can be measured; the trace still knows each node's
forward FLOPs (torch.utils.flop_counter on fake tensors) and every value's shape. A layer's
forward time is then the roofline bound, max(FLOPs / peak FLOP/s, bytes / memory bandwidth),
where the bytes are those the layer must touch: its inputs, outputs and parameters. FLOPs
and activation bytes grow linearly in the microbatch size u, parameter bytes do not, so the
bound is piecewise linear in u (memory-bound for small u, compute-bound beyond a breakpoint)
and fits the same `LayerProfile` the profiler fills (Srifty §3's model shape, exactly).
Backward costs twice the forward (two matmuls per forward matmul; Narayanan §4.2); a
recompute costs one forward. The stash is what autograd saves for the backward, counted on a
fake-tensor run of the whole graph (no memory allocated); where that run is impossible,
every floating-point value the layer makes, an upper bound.

Mixed precision (bf16 / fp16) is modelled to first order. Value bytes (inputs, outputs,
stash, workspace) come from the fake run under the precision's autocast, so they have the
dtypes autocast gives each op (matmul outputs and the casts they save in 2 bytes, norms and
softmax in 4). A device's `peak_flops`, when given, is its rate in the plan's precision (the
datasheet's bf16 figure for a bf16 plan: the catalogue picks it); the default peak for its kind
is fp32's, times LOW_PRECISION_SPEEDUP for its kind in bf16 / fp16: the datasheet's dense
bf16/fp16 tensor-core rate over its TF32 one on CUDA (A100: 312 / 156 TFLOP/s, H100: 989 / 495),
1 on CPU (without AMX, CPU bf16 matmuls are no faster).
Approximated: every FLOP is charged at that rate (the ops autocast keeps in fp32 are not
told apart), and the casts' own time is not charged. State (weights, gradients, optimizer
state) stays fp32: autocast computes from fp32 masters.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch
import torch.fx as fx
from torch.utils._pytree import tree_flatten

from stagewise.ir.choices import CostModel
from stagewise.ir.plan import Layer, LayerCost
from stagewise.passes.profile_fit import LayerProfile, PiecewiseLinear
from stagewise.passes.profile_layer import OPTIMIZER_STATE_FACTOR, layer_signature, layer_state_bytes
from stagewise.passes.profile_shapes import Shapes, shapes_at, tree_bytes

# Used when a device gives no figures: a modest CPU core set, and an older datacenter GPU.
DEFAULT_PEAK_FLOPS = {"cpu": 5e10, "cuda": 1e14}
DEFAULT_MEMORY_BANDWIDTH = {"cpu": 2e10, "cuda": 1e12}
BACKWARD_PER_FORWARD = 2.0  # a backward computes two matmuls per forward matmul (Narayanan §4.2)
LOW_PRECISION_SPEEDUP = {"cpu": 1.0, "cuda": 2.0}  # bf16 / fp16 peak over fp32's (module docstring)


def analytic_layers(
    gm: fx.GraphModule,
    layers: Sequence[Layer],
    traced_microbatch: int,
    device,
    *,
    optimizer_state_factor: float = OPTIMIZER_STATE_FACTOR,
    precision: str = "fp32",
) -> list[LayerProfile]:
    """One LayerProfile per layer from meta['flops'] and meta['val'] at the traced size.

    `device` is a `sw.Device` or `DeviceSpec`; its `peak_flops` and `memory_bandwidth`
    (else defaults for its kind, times its relative `speed`) set the roofline. A reduced
    `precision` is modelled as the module docstring says.
    """
    peak, bandwidth = device_rates(device)
    by_name = {n.name: n for n in gm.graph.nodes}
    fake = _fake_run(gm, layers, traced_microbatch, precision)
    saved = fake.stash_bytes if fake is not None else None
    cast = fake if precision != "fp32" else None  # meta['val'] holds the fp32 trace's values
    if precision != "fp32" and getattr(device, "peak_flops", None) is None:
        peak *= LOW_PRECISION_SPEEDUP.get(getattr(device, "kind", None) or _kind(device), 1.0)
    profiles = []
    for layer in layers:
        nodes = [by_name[name] for name in layer.nodes]
        per_u = 1.0 / traced_microbatch
        state = layer_state_bytes(gm, layer, optimizer_state_factor)
        act = cast.act_bytes[layer.index] if cast else sum(tree_bytes(by_name[v].meta.get("val")) for v in layer.outputs)
        inputs = (cast.input_bytes[layer.index] if cast
                  else sum(tree_bytes(by_name[v].meta.get("val")) for v in layer.inputs))
        workspace = (cast.largest_bytes[layer.index] if cast
                     else max((tree_bytes(n.meta.get("val")) for n in nodes), default=0))
        flops = sum(n.meta.get("flops", 0) for n in nodes)
        fwd = roofline(flops * per_u, (inputs + act) * per_u, state.param + state.buffers, peak, bandwidth)
        profiles.append(LayerProfile(
            layer=layer.index,
            name=layer.name,
            signature=layer_signature(gm, layer),
            source=CostModel.ANALYTIC,
            param_bytes=state.param,
            grad_bytes=state.grad,
            optim_bytes=state.optim,
            fwd_s=fwd,
            bwd_s=PiecewiseLinear(fwd.xs, tuple(BACKWARD_PER_FORWARD * y for y in fwd.ys)),
            recompute_s=fwd,
            act_bytes=_linear(act, traced_microbatch),
            stash_bytes=_linear(saved[layer.index] if saved else sum(_float_bytes(n.meta.get("val")) for n in nodes),
                                traced_microbatch),
            workspace_bytes=_linear(workspace, traced_microbatch),
        ))
    return profiles


def _fake_run(gm: fx.GraphModule, layers: Sequence[Layer], traced_microbatch: int, precision: str) -> Shapes | None:
    """Values and bytes autograd saves per layer at the traced size (a fake run under the
    precision's autocast), or None if it cannot run."""
    try:
        return shapes_at(gm, layers, traced_microbatch, traced_microbatch, precision)
    except Exception:  # noqa: BLE001 - fall back to the upper bound
        return None


def device_rates(device) -> tuple[float, float]:
    """(peak FLOP/s, memory bytes/s) of a Device or DeviceSpec, defaults by kind times speed."""
    kind = getattr(device, "kind", None) or _kind(device)
    speed = getattr(device, "speed", 1.0) or 1.0
    peak = getattr(device, "peak_flops", None) or DEFAULT_PEAK_FLOPS.get(kind, DEFAULT_PEAK_FLOPS["cpu"]) * speed
    bandwidth = getattr(device, "memory_bandwidth", None) or (
        DEFAULT_MEMORY_BANDWIDTH.get(kind, DEFAULT_MEMORY_BANDWIDTH["cpu"]) * speed
    )
    return float(peak), float(bandwidth)


def roofline(flops_per_u: float, bytes_per_u: float, fixed_bytes: float, peak: float,
             bandwidth: float) -> PiecewiseLinear:
    """max(a u, b u + c) with a = FLOPs per sample / peak, b = bytes per sample / bandwidth,
    c = fixed bytes / bandwidth: exact as knots at 0, the breakpoint, and one past it."""
    a, b, c = flops_per_u / peak, bytes_per_u / bandwidth, fixed_bytes / bandwidth
    if a <= b:
        return PiecewiseLinear((0.0, 1.0), (c, b + c))
    if c == 0:
        return PiecewiseLinear((0.0, 1.0), (0.0, a))
    knee = c / (a - b)
    return PiecewiseLinear((0.0, knee, knee + 1.0), (c, a * knee, a * (knee + 1.0)))


def compute_bound(cost: LayerCost, flops: float, peak_flops: float) -> LayerCost:
    """`cost` with its times the roofline's compute bound at `peak_flops`, for hardware one does not
    have: the forward's `flops` over the peak, the backward and a recompute as `analytic_layers`
    charges them (its bytes, which do not depend on the rate, stay)."""
    forward = flops / peak_flops
    return replace(cost, fwd_s=forward, bwd_s=BACKWARD_PER_FORWARD * forward, recompute_s=forward)


def _linear(value_at_traced: float, traced_microbatch: int) -> PiecewiseLinear:
    """Proportional in u: one knot at the traced size."""
    return PiecewiseLinear((float(traced_microbatch),), (float(value_at_traced),))


def _float_bytes(value) -> int:
    flat, _ = tree_flatten(value)
    return sum(t.numel() * t.element_size() for t in flat if isinstance(t, torch.Tensor) and t.is_floating_point())


def _kind(device) -> str:
    name = getattr(device, "name", device)
    return torch.device(name).type if isinstance(name, str | torch.device) else "cpu"
