"""One layer as the profiler sees it: a module of its own, a structural signature, its state bytes.

Layers with the same structure (the repeated blocks of a transformer) share a signature and
are profiled once.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch.fx.node import _get_qualified_name, map_arg
from torch.utils._pytree import tree_flatten

from stagewise.ir.costs import ADAMW_OPTIMIZER_BYTES
from stagewise.ir.plan import Layer
from stagewise.ir.subgraph import attribute, extract
from stagewise.passes.profile_shapes import nbytes

OPTIMIZER_STATE_FACTOR = ADAMW_OPTIMIZER_BYTES  # optimizer state per parameter byte where no optimizer is given


def layer_module(gm: fx.GraphModule, layer: Layer) -> fx.GraphModule:
    """The layer's nodes as a GraphModule of their own, with a private copy of its state (so
    profiling leaves the model's gradients alone)."""
    return extract(gm, layer.nodes, layer.inputs, layer.outputs, class_name=f"Layer{layer.index}")


def layer_signature(gm: fx.GraphModule, layer: Layer) -> str:
    """A hash of what the layer computes, blind to names: ops, targets, argument structure,
    constants and shapes. blocks.1 and blocks.2 of a transformer hash alike."""
    by_name = {n.name: n for n in gm.graph.nodes}
    local = {name: f"in{k}" for k, name in enumerate(layer.inputs)}
    items: list = [tuple(value_key(by_name[name].meta.get("val")) for name in layer.inputs)]
    for k, name in enumerate(layer.nodes):
        node = by_name[name]
        for arg in node.all_input_nodes:
            if arg.op == "get_attr" and arg.name not in local:
                local[arg.name] = f"attr{len(local)}"
                items.append(("get_attr", value_key(attribute(gm, arg.target))))
        args = map_arg((node.args, node.kwargs), lambda a: local.get(a.name, "?"))
        items.append((node.op, _target_key(gm, node), repr(args), value_key(node.meta.get("val"))))
        local[name] = f"n{k}"
    items.append(tuple(local[name] for name in layer.outputs))
    return hashlib.sha256(repr(items).encode()).hexdigest()[:16]


def _target_key(gm: fx.GraphModule, node: fx.Node) -> str:
    if node.op == "call_function":
        return _get_qualified_name(node.target) if callable(node.target) else str(node.target)
    if node.op == "call_module":
        module = gm.get_submodule(str(node.target))
        shapes = [(tuple(p.shape), str(p.dtype)) for p in module.parameters()]
        return f"{type(module).__qualname__}({module.extra_repr()}){shapes}"
    return str(node.target)


def value_key(value) -> str:
    """Shapes and dtypes of tensors; plain constants (a size, a flag) by value."""
    flat, _ = tree_flatten(value)
    return repr([(tuple(v.shape), str(v.dtype), v.requires_grad) if isinstance(v, torch.Tensor)
                 else v if isinstance(v, int | float | bool | str | None) else type(v).__name__
                 for v in flat])


@dataclass(frozen=True)
class LayerState:
    param: int
    grad: int
    optim: int
    buffers: int


def layer_state_bytes(gm: fx.GraphModule, layer: Layer, optimizer_state_factor: float) -> LayerState:
    """Exact parameter bytes (a tensor used twice in the layer counts once); gradients and
    optimizer state only for trainable ones."""
    params = {id(p): p for p in (gm.get_parameter(name) for name in layer.params)}.values()
    buffers = {id(b): b for b in (attribute(gm, name) for name in layer.buffers)}.values()
    param = sum(nbytes(p) for p in params)
    grad = sum(nbytes(p) for p in params if p.requires_grad)
    buffer = sum(nbytes(b) for b in buffers if isinstance(b, torch.Tensor))
    return LayerState(param, grad, round(optimizer_state_factor * grad), buffer)
