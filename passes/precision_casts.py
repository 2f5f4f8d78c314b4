"""Casts a trace at fp32 lost, put back for a stage that runs under torch.autocast.

torch.export records `x.float()` / `x.to(torch.float32)` on a tensor that was already fp32 as
`aten._assert_tensor_metadata(x, dtype=float32)` and lets later ops read `x` itself. Under
autocast `x` may be bf16 / fp16: the assertion fails, and the upcast eager autocast performs
(Hugging Face upcasts logits before the loss) would be lost. Each such assertion becomes the
cast it stood for, read by the ops after it in its layer (those of other layers receive `x`
across a cut as planned, and compute as the trace did, under autocast's policy for their op).
The cast takes the value (node.meta['val']) of what it makes, as every other node has one: the
assertion's is None, and a node without a tensor value carries no gradient in the cut analysis
(passes/cutpoints.value_info), which would cut the gradient path through it (a LoRA adapter's
output is cast back to the base layer's dtype: every stage before the last lost its gradients).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.fx as fx

from stagewise.ir.plan import Layer

_ASSERT = torch.ops.aten._assert_tensor_metadata.default
_CAST = torch.ops.aten._to_copy.default


def restore_casts(gm: fx.GraphModule, layers: Sequence[Layer]) -> fx.GraphModule:
    """`gm` (changed in place) with every dtype assertion an explicit cast; node names are kept."""
    layer_of = {name: layer.index for layer in layers for name in layer.nodes}
    order = {node: i for i, node in enumerate(gm.graph.nodes)}
    for node in list(gm.graph.nodes):
        dtype = node.kwargs.get("dtype") if node.op == "call_function" and node.target is _ASSERT else None
        if dtype is None or not isinstance(node.args[0], fx.Node):
            continue
        source = node.args[0]
        node.target, node.args, node.kwargs = _CAST, (source,), {"dtype": dtype}
        node.meta["val"] = _CAST(source.meta["val"], dtype=dtype)  # a new fake tensor, as the op makes
        for user in list(source.users):
            if order[user] > order[node] and layer_of.get(user.name) == layer_of.get(node.name):
                user.replace_input_with(source, node)
    gm.graph.lint()
    gm.recompile()
    return gm
