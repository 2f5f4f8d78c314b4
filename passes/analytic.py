"""Per-layer costs from the trace and a device's datasheet figures (cost="analytic").

For hardware one does not have, nothing can be measured; the trace still knows each node's
forward FLOPs (torch.utils.flop_counter on fake tensors) and every value's shape. A layer's
forward time is then the roofline bound, max(FLOPs / peak FLOP/s, bytes / memory bandwidth),
where the bytes are those the layer must touch: its inputs, outputs and parameters. FLOPs
and activation bytes grow linearly in the microbatch size u, parameter bytes do not, so the
bound is piecewise linear in u (memory-bound for small u, compute-bound beyond a breakpoint)
and fits the same `LayerProfile` the profiler fills (Srifty §3's model shape, exactly).
Backward costs twice the forward (two matmuls per forward matmul; Narayanan §4.2); a
recompute costs one forward. Each op also costs the host a fixed dispatch time in eager PyTorch
(Python, the dispatcher, autograd's bookkeeping), which the roofline does not see and which decides
small layers: OP_DISPATCH_S per forward op, BACKWARD_OP_RATIO times that for its backward, as
bench/op_dispatch.py measures them on a model's blocks (this 2-core CPU, 2026-11-27: about 12 us
forward and 12 us backward per op of the test zoo's GPT blocks, traced by torch.export or torch.fx;
a chain of the cheapest ops, matmul + gelu + add, 5 and 9 us). A CPU runs its kernels on the
dispatching thread, so the two add; a CUDA device runs them while the host dispatches the next, so a
layer takes the larger of the two. The stash is what autograd saves for the backward, counted on a
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
from itertools import pairwise

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
OP_DISPATCH_S = 12e-6  # host seconds per forward op in eager PyTorch (bench/op_dispatch.py, module docstring)
BACKWARD_OP_RATIO = 1.0  # a forward op's backward dispatch over its own (bench/op_dispatch.py)
RUNNING_OPS = ("call_function", "call_method", "call_module")
# ATen ops on sizes or checks (no kernel, no autograd node), and export's copy of a constant the
# forward makes (torch.tensor(0.5)): there only where the model was traced with real weights, so a
# model planned on the meta device would be charged differently for a scalar copy
NOT_DISPATCHED = ("sym_", "_assert", "lift_fresh")


def analytic_layers(
    gm: fx.GraphModule,
    layers: Sequence[Layer],
    traced_microbatch: int,
    device,
    *,
    optimizer_state_factor: float = OPTIMIZER_STATE_FACTOR,
    precision: str = "fp32",
    op_dispatch_s: float = OP_DISPATCH_S,
) -> list[LayerProfile]:
    """One LayerProfile per layer from meta['flops'] and meta['val'] at the traced size.

    `device` is a `sw.Device` or `DeviceSpec`; its `peak_flops` and `memory_bandwidth`
    (else defaults for its kind, times its relative `speed`) set the roofline. A reduced
    `precision` is modelled as the module docstring says; `op_dispatch_s` is the host's time per
    forward op (0: the roofline alone).
    """
    peak, bandwidth = device_rates(device)
    overlaps = (getattr(device, "kind", None) or _kind(device)) == "cuda"  # kernels run while the host goes on
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
        bound = roofline(flops * per_u, (inputs + act) * per_u, state.param + state.buffers, peak, bandwidth)
        dispatch = op_dispatch_s * sum(map(dispatches, nodes))
        fwd = _with_dispatch(bound, dispatch, overlaps)
        profiles.append(LayerProfile(
            layer=layer.index,
            name=layer.name,
            signature=layer_signature(gm, layer),
            source=CostModel.ANALYTIC,
            param_bytes=state.param,
            grad_bytes=state.grad,
            optim_bytes=state.optim,
            fwd_s=fwd,
            bwd_s=_with_dispatch(PiecewiseLinear(bound.xs, tuple(BACKWARD_PER_FORWARD * y for y in bound.ys)),
                                 BACKWARD_OP_RATIO * dispatch, overlaps),
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


def dispatches(node: fx.Node) -> bool:
    """Whether running `node` dispatches an op: modules, methods and functions, and Python's operators
    on a tensor (a torch.fx trace writes `x + y` and `w[:n]` as operator.add / getitem), but not those
    on sizes or tuples (size arithmetic, taking an output of a split), Python's builtins and math
    (getattr of .shape) nor ATen's size queries and checks."""
    if node.op not in RUNNING_OPS:
        return False
    if node.op != "call_function":
        return True
    module = getattr(node.target, "__module__", None)
    if module in ("_operator", "operator"):
        return any(isinstance(arg.meta.get("val"), torch.Tensor) for arg in node.all_input_nodes)
    if module in ("math", "builtins"):
        return False
    name = getattr(node.target, "__name__", "")
    return not any(name.startswith(prefix) for prefix in NOT_DISPATCHED)


def _with_dispatch(kernels: PiecewiseLinear, dispatch_s: float, overlaps: bool) -> PiecewiseLinear:
    """A pass's time from its kernels' and the host's dispatch of them: the larger where the device
    runs kernels while the host dispatches (CUDA), else their sum. Knots at the kernels' and where
    the two cross (past the last knot too, one more knot beyond it)."""
    if not overlaps:
        return PiecewiseLinear(kernels.xs, tuple(y + dispatch_s for y in kernels.ys))
    xs = sorted({*kernels.xs, *_crossings(kernels, dispatch_s)})
    return PiecewiseLinear(tuple(xs), tuple(max(kernels(x), dispatch_s) for x in xs))


def _crossings(kernels: PiecewiseLinear, level: float) -> list[float]:
    """Where the piecewise-linear `kernels` (at least two knots) crosses the constant `level`, and a
    knot past a crossing beyond the last knot, where the kernels' line goes on rising."""
    points = list(zip(kernels.xs, kernels.ys, strict=True))
    crossings = [x0 + (level - y0) * (x1 - x0) / (y1 - y0) for (x0, y0), (x1, y1) in pairwise(points)
                 if min(y0, y1) < level < max(y0, y1)]
    (x0, y0), (x1, y1) = points[-2], points[-1]
    if y1 < level and y1 > y0:
        beyond = x1 + (level - y1) * (x1 - x0) / (y1 - y0)
        crossings += [beyond, beyond + 1.0]
    return crossings


def _linear(value_at_traced: float, traced_microbatch: int) -> PiecewiseLinear:
    """Proportional in u: one knot at the traced size."""
    return PiecewiseLinear((float(traced_microbatch),), (float(value_at_traced),))


def _float_bytes(value) -> int:
    flat, _ = tree_flatten(value)
    return sum(t.numel() * t.element_size() for t in flat if isinstance(t, torch.Tensor) and t.is_floating_point())


def _kind(device) -> str:
    name = getattr(device, "name", device)
    return torch.device(name).type if isinstance(name, str | torch.device) else "cpu"
