"""What a split backward (zero bubble's B and W) costs beyond a whole one on this machine, per layer.

runtime/split_backward.py splits a stage's backward with Python around autograd: prehooks on the
frontier nodes, a walk of the graph, one autograd call per group of weights. On a GPU the host
issues that ahead of the device; on a CPU it adds to the compute, a fixed time per backward that
the profile (one whole backward per layer) does not see: two GPT blocks at d=32, 8 tokens, took
0.82 ms whole and 6.33 ms split on this 2-core machine, where at d=256 the split cost nothing. So
each distinct layer kind is timed both ways on its own copy at the traced microbatch size (B then
W against one backward, each the least disturbed of REPEATS after a warm-up), and what the split
adds is charged to every layer of that kind (passes/costs.py `stage_charges`). Measured once per
machine and layer kind (passes/machine_cache.py), so the plan does not follow the load.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Sequence

import torch
import torch.fx as fx
from torch.utils._pytree import tree_flatten

from stagewise.ir.plan import Layer
from stagewise.passes.machine_cache import remembered
from stagewise.passes.profile_layer import layer_module, layer_signature
from stagewise.passes.profile_measure import least_disturbed, real_inputs
from stagewise.passes.profile_shapes import shapes_at
from stagewise.runtime.split_backward import input_grads

REPEATS = 7  # timings of each way, alternating, the least disturbed kept


def split_backward_seconds(gm: fx.GraphModule, layers: Sequence[Layer], traced_microbatch: int) -> tuple[float, ...]:
    """Per layer, the seconds a split backward adds to its whole backward on this machine's CPU (0 where
    splitting costs nothing more), measured once per layer kind."""
    values = functools.cache(lambda: shapes_at(gm, layers, traced_microbatch, traced_microbatch).values)
    by_kind: dict[str, float] = {}
    for layer in layers:
        kind = layer_signature(gm, layer)
        if kind not in by_kind:
            measure = functools.partial(_extra_seconds, gm, layer, values)
            by_kind[kind] = remembered("split-backward", (kind, traced_microbatch), measure, float)
    return tuple(by_kind[layer_signature(gm, layer)] for layer in layers)


def _extra_seconds(gm: fx.GraphModule, layer: Layer, values) -> float:
    """The least disturbed split backward (B then W) of the layer less its least disturbed whole one."""
    module = layer_module(gm, layer)
    args = real_inputs([values()[name] for name in layer.inputs], torch.device("cpu"))
    if not any(p.requires_grad for p in module.parameters()):
        return 0.0  # no weights: W has nothing to do, and B is the whole backward
    whole, split = [], []
    for _ in range(REPEATS + 1):  # the first round warms up
        whole.append(_backward_seconds(module, args, split=False))
        split.append(_backward_seconds(module, args, split=True))
    return max(least_disturbed(split[1:]) - least_disturbed(whole[1:]), 0.0)


def _backward_seconds(module: torch.nn.Module, args: list, split: bool) -> float:
    """Seconds of one backward of the layer, whole (as the runtime's B) or as B then W (its Bi and W)."""
    inputs = [t for t in tree_flatten(args)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
    outputs = [t for t in tree_flatten(module(*args))[0]
               if isinstance(t, torch.Tensor) and t.requires_grad and t.is_floating_point()]
    grads = [torch.ones_like(t) for t in outputs]
    weights = [p for p in module.parameters() if p.requires_grad]
    began = time.perf_counter()
    if split:
        _, weight_pass = input_grads(outputs, grads, inputs, weights)
        weight_pass.run()
    elif outputs:
        torch.autograd.backward(outputs, grads)
    seconds = time.perf_counter() - began
    module.zero_grad(set_to_none=True)
    for t in inputs:
        t.grad = None
    return seconds
