"""Legal cut-points between consecutive layers (Varuna §5.1, Harmony §4.1).

Cut i lies between layer i and layer i+1. The values crossing it are those made at or
before layer i and used after it: skip connections cross every cut they span. A cut is
legal when every crossing value is a tensor (a Python int or shape cannot be sent, and
would pin the stage to one batch size); bytes per sample come from the fake-tensor shapes.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from stagewise.ir.plan import CrossingValue, Cut, Layer
from stagewise.ir.subgraph import attribute


def value_info(gm: fx.GraphModule, microbatch_size: int) -> dict[str, CrossingValue]:
    """Per node: bytes per sample, whether it is a tensor, and whether gradients flow through it."""
    grad: dict[fx.Node, bool] = {}
    info = {}
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        is_tensor = isinstance(val, torch.Tensor)
        floating = _holds_floating(val)
        if node.op == "get_attr":
            attr = attribute(gm, node.target)
            grad[node] = isinstance(attr, torch.nn.Parameter) and attr.requires_grad
        elif node.op == "placeholder":
            grad[node] = False
        elif node.op == "call_module":
            module = gm.get_submodule(node.target)
            trainable = any(p.requires_grad for p in module.parameters())
            grad[node] = floating and (trainable or any(grad.get(a, False) for a in node.all_input_nodes))
        else:
            grad[node] = floating and any(grad.get(a, False) for a in node.all_input_nodes)
        nbytes = val.numel() * val.element_size() if is_tensor else 0
        info[node.name] = CrossingValue(node.name, nbytes / microbatch_size, is_tensor, grad[node])
    return info


def _holds_floating(value: object) -> bool:
    """A floating (or complex) tensor, or a tuple / list holding one: gradients flow through
    `split`, `chunk` or `unbind` into the items taken from it (a LoRA adapter whose output is split
    into q, k, v is the first trainable op of its block)."""
    if isinstance(value, (tuple, list)):
        return any(_holds_floating(item) for item in value)
    return isinstance(value, torch.Tensor) and (value.is_floating_point() or value.is_complex())


def find_cuts(gm: fx.GraphModule, layers: tuple[Layer, ...], microbatch_size: int) -> tuple[Cut, ...]:
    info = value_info(gm, microbatch_size)
    layer_of = {name: layer.index for layer in layers for name in layer.nodes}
    spans = []  # (made in layer, last used in layer, value)
    for node in gm.graph.nodes:
        if node.name not in layer_of:
            continue
        users = [layer_of[u.name] for u in node.users if u.name in layer_of]
        if users and max(users) > layer_of[node.name]:
            spans.append((layer_of[node.name], max(users), info[node.name]))
    cuts = []
    for after in range(len(layers) - 1):
        values = tuple(v for made, last, v in spans if made <= after < last)
        bad = [v.name for v in values if not v.is_tensor]
        reason = f"non-tensor values cross it: {', '.join(bad)}" if bad else ""
        cuts.append(Cut(after, values, not bad, reason))
    return tuple(cuts)

