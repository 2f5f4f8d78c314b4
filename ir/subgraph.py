"""Cut a set of nodes out of the whole-model graph as a GraphModule of its own.

Used for stage modules (codegen) and for the profiler's single-layer modules: placeholders for
the values the nodes receive, `get_attr` and `call_module` for their state under the original
FQNs, and the chosen values returned as a tuple. The state is deep-copied in one call, so a
tensor used twice inside the subgraph (a tie not split by the cut) stays one tensor.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable

import torch
import torch.fx as fx


def extract(gm: fx.GraphModule, nodes: Iterable[str], inputs: Iterable[str], outputs: Iterable[str],
            class_name: str) -> fx.GraphModule:
    by_name = {n.name: n for n in gm.graph.nodes}
    members = set(nodes)
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {by_name[name]: graph.placeholder(name) for name in inputs}
    attrs: dict[str, object] = {}
    for node in gm.graph.nodes:
        if node.name not in members:
            continue
        for arg in node.all_input_nodes:
            if arg.op == "get_attr" and arg not in env:
                env[arg] = graph.node_copy(arg)
                attrs[arg.target] = attribute(gm, arg.target)
        if node.op == "call_module":
            attrs[node.target] = gm.get_submodule(node.target)
        env[node] = graph.node_copy(node, lambda n: env[n])
    graph.output(tuple(env[by_name[name]] for name in outputs))
    return fx.GraphModule(copy.deepcopy(attrs), graph, class_name=class_name)


def attribute(root: torch.nn.Module, target: str):
    """`root.a.b.c` for target 'a.b.c'."""
    obj = root
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj
