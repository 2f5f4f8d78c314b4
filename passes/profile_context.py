"""Layers timed in context (PipeDream §2.4.1): how much slower each runs among the others than alone.

Layers run alone are faster than in a stage: a probe repeats one layer on the same inputs, so
its weights and activations stay in cache. All layers are run back to back at the traced
size, forwards in order and backwards in reverse, each timed: the ratio to its probe scales
the layer's times.
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx as fx

from stagewise.ir.devices import Device
from stagewise.ir.plan import Layer
from stagewise.ir.precision import autocast_for
from stagewise.passes.capture_functional import modifies_input
from stagewise.passes.profile_fit import LayerProfile
from stagewise.passes.profile_layer import layer_module
from stagewise.passes.profile_measure import least_disturbed, real_inputs, timed
from stagewise.passes.profile_shapes import Shapes

CONTEXT_REPEATS = 9  # passes timed for the factors: with 3 a whole-graph factor spread 0.97-1.59 here, with 9 1.03-1.12
CONTEXT_MIN_REPEATS = 3  # ... but past CONTEXT_BUDGET_S of passes, this many do (a large model's identical
CONTEXT_BUDGET_S = 1.0  # layers, each timed once a pass, still give their shared factor many samples)
CONTEXT_RANGE = (0.5, 2.0)  # an in-context / alone ratio outside this is a disturbed measurement
COMPILED_RANGE = (0.05, 2.0)  # ... and of a compiled layer's against its eager probe (fusion can gain much)


def in_context_factors(gm: fx.GraphModule, layers: Sequence[Layer], profiles: Sequence[LayerProfile],
                       shapes: Shapes, device: Device, repeats: int = CONTEXT_REPEATS,
                       precision: str = "fp32", compiled: bool = False) -> list[tuple[float, float]]:
    """Per layer, how much slower its forward and its backward run back to back with the other
    layers than on their own: (forward factor, backward factor).

    A probe repeats one layer on the same inputs, so its weights and activations stay in cache;
    in a stage each layer meets the previous one's output and its own weights cold. PipeDream
    (dissertation §2.4.1) times layers inside whole training iterations for this reason. Here
    every layer runs in model order at the traced size on its predecessors' real outputs, each
    forward timed, then every backward in reverse order, each fed the gradients its consumers
    produced (the least disturbed of `repeats` passes after a warm-up, as the probes are; of at
    least CONTEXT_MIN_REPEATS once the passes took CONTEXT_BUDGET_S). Identical layers share the median of their factors. Measured only where the model already lives on `device` (no copy of a model
    that may not fit); (1, 1) elsewhere, on OOM, and for a factor outside CONTEXT_RANGE.
    Forwards run under the precision's autocast. `compiled` (compile_stages): each layer runs through
    torch.compile (compiled in the warm-up pass), so the factors carry the eager probes to compiled times.
    """
    where = device.torch_device
    neutral = [(1.0, 1.0)] * len(layers)
    if any(t.device.type != where.type for t in (*gm.parameters(), *gm.buffers())):
        return neutral
    modules = [layer_module(gm, layer).to(where) for layer in layers]
    calls: list[Callable[..., Any]] = [torch.compile(m) for m in modules] if compiled else list(modules)
    placeholders = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    inputs = dict(zip(placeholders, real_inputs([shapes.values[name] for name in placeholders], where), strict=True))
    outputs = {n.name for n in gm.graph.output_node().all_input_nodes}
    times: list[tuple[list[float], list[float]]] = [([], []) for _ in layers]
    cuda = [where.index or 0] if where.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=cuda):
            _layers_back_to_back(layers, modules, inputs, outputs, where, precision, calls)  # warm-up
            began = time.perf_counter()
            for run in range(repeats):
                if run >= CONTEXT_MIN_REPEATS and time.perf_counter() - began > CONTEXT_BUDGET_S:
                    break
                passed = _layers_back_to_back(layers, modules, inputs, outputs, where, precision, calls)
                for (fwd, bwd), seconds in zip(times, passed, strict=True):
                    fwd.append(seconds[0])
                    bwd.append(seconds[1])
    except torch.OutOfMemoryError:
        torch.cuda.empty_cache()
        return neutral
    traced = shapes.u
    bounds = COMPILED_RANGE if compiled else CONTEXT_RANGE
    ratios = [(_ratio(least_disturbed(fwd), p.fwd_s(traced), bounds), _ratio(least_disturbed(bwd), p.bwd_s(traced), bounds))
              for (fwd, bwd), p in zip(times, profiles, strict=True)]
    by_signature: dict[str, list[tuple[float, float]]] = {}
    for p, ratio in zip(profiles, ratios, strict=True):
        by_signature.setdefault(p.signature, []).append(ratio)
    return [_medians(by_signature[p.signature]) for p in profiles]


def _medians(ratios: list[tuple[float, float]]) -> tuple[float, float]:
    """The factors identical layers share: the median of their forward ratios, of their backward ratios."""
    return statistics.median(r[0] for r in ratios), statistics.median(r[1] for r in ratios)


def _placeholders(module: fx.GraphModule) -> list[fx.Node]:
    return [n for n in module.graph.nodes if n.op == "placeholder"]


def _written_inputs(module: fx.GraphModule) -> set[fx.Node]:
    """The layer's inputs an in-place op left by the capture (a view modified in place) writes into."""
    return {n.args[0] for n in module.graph.nodes
            if n.args and isinstance(n.args[0], fx.Node) and n.args[0].op == "placeholder" and modifies_input(module, n)}


def _ratio(in_context: float, alone: float, bounds: tuple[float, float]) -> float:
    factor = in_context / alone if alone > 0 else 1.0
    return factor if bounds[0] <= factor <= bounds[1] else 1.0


def _layers_back_to_back(layers: Sequence[Layer], modules: Sequence[fx.GraphModule], inputs: dict[str, Any],
                         outputs: set[str], where: torch.device, precision: str = "fp32",
                         calls: Sequence[Callable[..., Any]] | None = None) -> list[tuple[float, float]]:
    """One pass: each layer's forward in order (through `calls`, the modules compiled; default the
    modules), then each backward in reverse; (fwd s, bwd s) per layer.
    A layer's floating inputs are leaves of their own, so its backward stops at its boundary and
    their gradients are what its producers' backwards receive."""
    values = dict(inputs)
    leaves: list[list[tuple[str, torch.Tensor]]] = []
    results: list[tuple] = []
    forward_s = []
    for layer, module, call in zip(layers, modules, calls or modules, strict=True):
        args, mine = [], []
        written = _written_inputs(module)
        for name, placeholder in zip(layer.inputs, _placeholders(module), strict=True):
            value = values[name]
            if isinstance(value, torch.Tensor) and value.is_floating_point() and value.requires_grad:
                value = value.detach().requires_grad_()
                mine.append((name, value))
            if placeholder in written and isinstance(value, torch.Tensor):
                value = value.clone()  # a leaf may not be modified in place; nor may a value others read
            args.append(value)
        # timed calls it at once, in this iteration
        seconds, result = timed(lambda: _cast_call(call, args, precision, where), where)  # noqa: B023
        forward_s.append(seconds)
        values.update(zip(layer.outputs, result, strict=True))
        leaves.append(mine)
        results.append(result)
    grads = {name: torch.ones_like(values[name]) for name in outputs
             if isinstance(values.get(name), torch.Tensor) and values[name].requires_grad}
    backward_s = [0.0] * len(layers)
    for i in reversed(range(len(layers))):
        roots = [(t, grads.pop(name)) for name, t in zip(layers[i].outputs, results[i], strict=True)
                 if name in grads and isinstance(t, torch.Tensor) and t.requires_grad]
        if roots:
            tensors, seeds = zip(*roots, strict=True)
            backward_s[i], _ = timed(functools.partial(torch.autograd.backward, list(tensors), list(seeds)), where)
        for name, leaf in leaves[i]:
            if leaf.grad is not None:
                grads[name] = grads[name] + leaf.grad if name in grads else leaf.grad
        modules[i].zero_grad(set_to_none=True)
    return list(zip(forward_s, backward_s, strict=True))


def _cast_call(call: Callable[..., Any], args: list, precision: str, where: torch.device):
    with autocast_for(precision, where):
        return call(*args)
