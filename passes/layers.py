"""Group graph nodes into layers along module boundaries (Harmony §4.1 decomposer, Varuna §5.1).

A node belongs to the *atomic* module on its module path: the first module that is either
an element of a container (ModuleList / Sequential / ModuleDict: a repeated block) or a leaf.
Nodes that live in a non-atomic module's own forward (glue such as `x + pos_emb` in
`GPT2Model.forward`) join the next layer; trailing glue (the loss) joins the last layer.
Maximal runs of nodes with the same key, in topological order, are the layers.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.fx as fx

from stagewise.ir.plan import Layer
from stagewise.ir.subgraph import LAYER_NAME

_CONTAINERS = (torch.nn.ModuleList, torch.nn.Sequential, torch.nn.ModuleDict)
COMPUTE_OPS = ("call_function", "call_method", "call_module")


def atomic_module(path: str, modules: dict[str, torch.nn.Module]) -> str | None:
    """The layer key of a module path, or None when the path is glue of a composite module."""
    if not path:
        return None
    parts = path.split(".")
    for depth in range(1, len(parts) + 1):
        prefix = ".".join(parts[:depth])
        module = modules.get(prefix)
        parent = modules.get(".".join(parts[: depth - 1]))
        if module is None or isinstance(parent, _CONTAINERS) or not any(True for _ in module.children()):
            return prefix
    return None


def layer_runs(gm: fx.GraphModule, model: torch.nn.Module) -> list[tuple[str, list[fx.Node]]]:
    """The compute nodes in maximal runs of one layer key, in topological order: the layers to be."""
    modules = dict(model.named_modules())
    compute = [n for n in gm.graph.nodes if n.op in COMPUTE_OPS]
    keys = [n.meta[LAYER_NAME] if LAYER_NAME in n.meta else atomic_module(n.meta.get("module_path", ""), modules)
            for n in compute]  # a saved graph's nodes name their layer (no module tree to read)
    next_key = None
    for i in range(len(keys) - 1, -1, -1):  # glue joins the next layer
        keys[i] = keys[i] if keys[i] is not None else next_key
        next_key = keys[i]
    last = next((k for k in reversed(keys) if k is not None), "model")
    layer_keys = [k if k is not None else last for k in keys]  # trailing glue (the loss) joins the last layer
    runs: list[tuple[str, list[fx.Node]]] = []
    for node, key in zip(compute, layer_keys, strict=True):
        if runs and runs[-1][0] == key:
            runs[-1][1].append(node)
        else:
            runs.append((key, [node]))
    return runs


def build_layers(gm: fx.GraphModule, model: torch.nn.Module) -> tuple[Layer, ...]:
    """Layers of the traced graph; `model` (the user's module tree) tells containers from blocks."""
    runs = layer_runs(gm, model)

    seen: dict[str, int] = {}
    layer_of = {n: i for i, (_, nodes) in enumerate(runs) for n in nodes}
    param_names = {k for k, _ in gm.named_parameters(remove_duplicate=False)}
    layers = []
    for index, (key, nodes) in enumerate(runs):
        seen[key] = seen.get(key, 0) + 1
        name = key if seen[key] == 1 else f"{key}#{seen[key]}"
        targets = state_targets(gm, nodes)
        params = tuple(t for t in targets if t in param_names)
        buffers = tuple(t for t in targets if t not in param_names)
        inputs = _unique(a.name for n in nodes for a in n.all_input_nodes if layer_of.get(a) != index and a.op != "get_attr")
        outputs = _unique(n.name for n in nodes if any(layer_of.get(u) != index for u in n.users))
        param_bytes = sum(_nbytes(gm.get_parameter(p)) for p in params)
        flops = sum(n.meta.get("flops", 0) for n in nodes)
        layers.append(Layer(index, name, tuple(n.name for n in nodes), params, buffers, inputs, outputs, param_bytes, flops))
    return tuple(layers)


def state_targets(gm: fx.GraphModule, nodes: Iterable[fx.Node]) -> tuple[str, ...]:
    """FQNs of the parameters, buffers and constants the nodes read (get_attr or call_module)."""
    targets: list[str] = []
    for node in nodes:
        if node.op == "call_module":
            module = gm.get_submodule(str(node.target))
            prefix = f"{node.target}."
            targets += [prefix + k for k, _ in module.named_parameters(remove_duplicate=False)]
            targets += [prefix + k for k, _ in module.named_buffers(remove_duplicate=False)]
        targets += [str(a.target) for a in node.all_input_nodes if a.op == "get_attr"]
    return _unique(targets)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _unique(items: Iterable[str]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(items))
