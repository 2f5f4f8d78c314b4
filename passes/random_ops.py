"""Every random op of the whole-model graph rewritten to draw from its keyed stream
(ir/random_streams.py), numbered in graph order: the number is the op's identity in the whole
model, so a draw does not depend on where the partition puts the op.

Dropout (`nn.Dropout`, `F.dropout`, ATen's `dropout`) becomes `keyed_dropout(op, input, p, train)`;
any other random op becomes `keyed(op, function, *args)`: an ATen op tagged
`nondeterministic_seeded` (torch.export graphs), a torch-level random function or tensor method
(`TorchRandom`, fx graphs), or a torch.nn leaf module that draws inside (Dropout2d, RReLU,
MultiheadAttention or an RNN with dropout), called through a `get_attr` of the module. Ops that
cannot draw as traced (dropout with p = 0 or in eval mode, attention without dropout) stay as
they are, so such a model's code is unchanged and trains bitwise as eager does.

Run at codegen, on a copy: the costs and the profiler see the model's own ops.
"""

from __future__ import annotations

import inspect

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from stagewise.ir.random_streams import TorchRandom, keyed, keyed_dropout

_DROPOUT_FUNCTIONS = (F.dropout, torch.ops.aten.dropout.default)
_DROPOUT_SIGNATURE = inspect.signature(keyed_dropout)
_TORCH_RANDOM = {member.value: member for member in TorchRandom}
_TENSOR_METHODS = {member.value.__name__: member for member in TorchRandom if member.name.startswith("tensor_")}


def key_random_ops(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of `gm` whose random ops draw from keyed streams; node names are kept (layers name them)."""
    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    op = 0
    for node in list(graph.nodes):
        if _rewrite(gm, graph, node, op):
            op += 1
    graph.lint()
    return fx.GraphModule(gm, graph, class_name=type(gm).__name__)


def _rewrite(gm: fx.GraphModule, graph: fx.Graph, node: fx.Node, op: int) -> bool:
    """Make `node` draw from op `op`'s stream, if it is a random op that can draw; whether it was."""
    if node.op == "call_module":
        return _rewrite_module(gm, graph, node, op)
    if node.op == "call_method" and node.target in _TENSOR_METHODS:
        _call_keyed(node, op, _TENSOR_METHODS[str(node.target)])
        return True
    if node.op != "call_function":
        return False
    target = node.target
    if target in _DROPOUT_FUNCTIONS:
        return _rewrite_dropout(node, op)
    if _is_attention(target):
        if _literal(node, 4, "dropout_p", 0.0) == 0.0:  # (query, key, value, attn_mask, dropout_p, ...)
            return False
    elif not _draws(target):
        return False
    _call_keyed(node, op, target if isinstance(target, torch._ops.OpOverload) else _TORCH_RANDOM[target])
    return True


def _rewrite_dropout(node: fx.Node, op: int) -> bool:
    """`keyed_dropout(op, input, p, train, inplace)` from F.dropout's or ATen's arguments."""
    names = ("input", "p", "train", "inplace")
    given = {**dict(zip(names, node.args, strict=False)),
             **{("train" if k == "training" else k): v for k, v in node.kwargs.items()}}
    bound = _DROPOUT_SIGNATURE.bind(op, **given)
    bound.apply_defaults()
    if not _may_draw(bound.arguments["p"], bound.arguments["train"]):
        return False
    node.target = keyed_dropout
    node.args = tuple(bound.arguments[name] for name in ("op", *names))
    node.kwargs = {}
    return True


def _rewrite_module(gm: fx.GraphModule, graph: fx.Graph, node: fx.Node, op: int) -> bool:
    """A torch.nn leaf that draws: nn.Dropout as `keyed_dropout`, any other through `keyed`."""
    module = gm.get_submodule(str(node.target))
    if type(module) is nn.Dropout:
        if not _may_draw(module.p, module.training):
            return False
        node.op, node.target = "call_function", keyed_dropout
        node.args = (op, node.args[0], module.p, module.training, module.inplace)
        return True
    if not _module_draws(module):
        return False
    with graph.inserting_before(node):
        attribute = graph.get_attr(str(node.target))
    attribute.meta = dict(node.meta)
    attribute._rename(f"{node.name}_module")
    node.op = "call_function"
    _call_keyed(node, op, attribute)
    return True


def _call_keyed(node: fx.Node, op: int, function) -> None:
    node.op, node.target = "call_function", keyed
    node.args = (op, function, *node.args)


def _may_draw(p, train) -> bool:
    """Dropout draws unless its probability or mode, known when traced, say it cannot."""
    return not (isinstance(p, int | float) and p == 0) and train is not False


def _module_draws(module: nn.Module) -> bool:
    """A torch.nn module in training mode that draws: RReLU, or a dropout (of its own or inside it,
    as in MultiheadAttention or an RNN) with a probability above 0."""
    if not module.training:
        return False
    if isinstance(module, nn.RReLU):
        return True
    for inner in module.modules():
        if isinstance(inner, nn.modules.dropout._DropoutNd) and inner.p > 0 and inner.training:
            return True
    return isinstance(module, nn.MultiheadAttention | nn.RNNBase) and module.dropout > 0


def _draws(target) -> bool:
    """An ATen op tagged as drawing from a generator, or a torch-level random function."""
    if isinstance(target, torch._ops.OpOverload):
        return torch.Tag.nondeterministic_seeded in target.tags
    try:
        return target in _TORCH_RANDOM
    except TypeError:  # an unhashable target
        return False


def _is_attention(target) -> bool:
    return target in (F.scaled_dot_product_attention, torch.ops.aten.scaled_dot_product_attention.default)


def _literal(node: fx.Node, position: int, name: str, default: float):
    """An argument of `node` by position or keyword (a Node where it is computed)."""
    if len(node.args) > position:
        return node.args[position]
    return node.kwargs.get(name, default)
