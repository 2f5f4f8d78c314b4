"""`torch.no_grad()` regions of an exported graph written inline, their inputs detached.

torch.export (pre-dispatch, non-strict) turns a `with torch.no_grad():` block of the model's
forward into a higher-order op, `wrap_with_set_grad_enabled(False, submodule, *inputs)`, whose
body is a GraphModule of its own (Hugging Face's rotary embeddings in transformers 5.17 run under
`@torch.no_grad()`). A stage is plain ATen code over one flat graph: a call into a nested graph
module can neither be cut, nor costed node by node, nor saved as a stage structure.

Inlined, the body's ops must still make no autograd history, as eager's do under no_grad: every
tensor entering the region is read through `aten.detach` (an alias sharing storage and version
counter), so nothing computed there requires grad nor saves tensors for backward, and an in-place
update in the region (a running statistic) still writes the tensor it named. Export keeps only
regions whose grad mode differs from the one it traces under, grad on (capture_tracers._export):
a `torch.enable_grad()` block nested in a no_grad one is already part of its region, and a region
with grad enabled, were one found, is inlined as it is.
"""

from __future__ import annotations

import operator
from typing import cast

import torch
import torch.fx as fx
from torch._higher_order_ops.wrap import wrap_with_set_grad_enabled

from stagewise.ir.errors import TraceError


def inline_grad_regions(gm: fx.GraphModule) -> None:
    """Inline every `wrap_with_set_grad_enabled` of `gm` (innermost first), detaching a no_grad
    region's tensor inputs; the region's submodules are dropped."""
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target is wrap_with_set_grad_enabled:
            _inline(gm, node)
    gm.delete_all_unused_submodules()
    gm.recompile()


def _inline(gm: fx.GraphModule, region: fx.Node) -> None:
    """Replace one region's node by its body's nodes, and its results' getitems by theirs."""
    # (grad mode, export's get_attr of the region's graph module, the nodes the region reads)
    grad_enabled, body_node, inputs = region.args[0], cast(fx.Node, region.args[1]), cast(list, region.args[2:])
    body = getattr(gm, str(body_node.target))
    inline_grad_regions(body)
    stray = [n.target for n in body.graph.nodes if n.op == "get_attr"]
    if stray:
        raise TraceError(f"the torch.no_grad() region {region.name!r} reads attributes {stray} of its own "
                         "graph module, which cannot be inlined: pass them to the region as tensors "
                         "computed outside it, or move them out of the torch.no_grad() block")
    graph = gm.graph
    with graph.inserting_before(region):
        entering = [_detached(graph, value, region) if not grad_enabled else value for value in inputs]
        placeholders = [n for n in body.graph.nodes if n.op == "placeholder"]
        # export's region bodies return a tuple, read by getitem
        results = cast(tuple, graph.graph_copy(body.graph, dict(zip(placeholders, entering, strict=True))))
    for user in list(region.users):
        if user.op != "call_function" or user.target is not operator.getitem:
            raise TraceError(f"{user.name!r} reads the torch.no_grad() region {region.name!r} whole, not one "
                             "of its results: stagewise cannot inline such a region")
        user.replace_all_uses_with(results[cast(int, user.args[1])])
        graph.erase_node(user)
    graph.erase_node(region)
    if not body_node.users:
        graph.erase_node(body_node)


def _detached(graph: fx.Graph, value: fx.Node, region: fx.Node) -> fx.Node:
    """`value` read without autograd history: a detached alias of a tensor, a size as it is."""
    if not isinstance(value.meta.get("val"), torch.Tensor):
        return value
    alias = graph.call_function(torch.ops.aten.detach.default, (value,))
    alias.meta = {**region.meta, "val": value.meta["val"].detach()}
    if "tensor_meta" in value.meta:
        alias.meta["tensor_meta"] = value.meta["tensor_meta"]
    return alias
