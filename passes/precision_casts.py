"""Casts a trace at fp32 lost, put back for a stage that runs under torch.autocast.

torch.export records `x.float()` / `x.to(torch.float32)` on a tensor that was already fp32 as
`aten._assert_tensor_metadata(x, dtype=float32)` and lets later ops read `x` itself. Under
autocast `x` may be bf16 / fp16: the assertion fails, and the upcast eager autocast performs
(Hugging Face upcasts logits before the loss) would be lost. Each such assertion becomes the
cast it stood for, read by the ops after it in its layer (those of other layers receive `x`
across a cut as planned, and compute as the trace did, under autocast's policy for their op).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.fx as fx

from stagewise.ir.plan import Layer

_ASSERT = torch.ops.aten._assert_tensor_metadata.default


def restore_casts(gm: fx.GraphModule, layers: Sequence[Layer]) -> fx.GraphModule:
    """`gm` (changed in place) with every dtype assertion an explicit cast; node names are kept."""
    layer_of = {name: layer.index for layer in layers for name in layer.nodes}
    order = {node: i for i, node in enumerate(gm.graph.nodes)}
    for node in list(gm.graph.nodes):
        dtype = node.kwargs.get("dtype") if node.op == "call_function" and node.target is _ASSERT else None
        if dtype is None or not isinstance(node.args[0], fx.Node):
            continue
        source = node.args[0]
        node.target, node.args, node.kwargs = torch.ops.aten._to_copy.default, (source,), {"dtype": dtype}
        for user in list(source.users):
            if order[user] > order[node] and layer_of.get(user.name) == layer_of.get(node.name):
                user.replace_input_with(source, node)
    gm.graph.lint()
    gm.recompile()
    return gm
