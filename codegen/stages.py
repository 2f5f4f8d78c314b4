"""One torch.fx.GraphModule per stage, cut out of the whole-model graph.

Node names come from the model (`transformer_h_3`, `blocks_1_attn_linear`), placeholders
are named after the values the stage receives, and parameters stay under their original
FQNs, so `stage.code` reads like hand-written code and `stage.state_dict()` keys match the
model's. Each stage gets its own copy of the state it uses; a tensor used twice inside one
stage (a tie that the partition did not split) stays one tensor there.
"""

from __future__ import annotations

import copy

import torch
import torch.fx as fx
from stagewise.compiler.ir import Layer, Stage


def build_stage_modules(gm: fx.GraphModule, layers: tuple[Layer, ...], stages: tuple[Stage, ...]) -> list[fx.GraphModule]:
    return [build_stage_module(gm, layers, stage) for stage in stages]


def build_stage_module(gm: fx.GraphModule, layers: tuple[Layer, ...], stage: Stage) -> fx.GraphModule:
    by_name = {n.name: n for n in gm.graph.nodes}
    members = {name for i in stage.layers for name in layers[i].nodes}
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for name in stage.inputs:
        env[by_name[name]] = graph.placeholder(name)
    attrs: dict[str, object] = {}
    for node in gm.graph.nodes:
        if node.name not in members:
            continue
        for arg in node.all_input_nodes:
            if arg.op == "get_attr" and arg not in env:
                env[arg] = graph.node_copy(arg)
                attrs[arg.target] = _attr(gm, arg.target)
        if node.op == "call_module":
            attrs[node.target] = gm.get_submodule(node.target)
        env[node] = graph.node_copy(node, lambda n: env[n])
    graph.output(tuple(env[by_name[name]] for name in stage.outputs))
    owned = copy.deepcopy(attrs)  # one deepcopy: objects shared inside the stage stay shared
    module = fx.GraphModule(owned, graph, class_name=f"Stage{stage.index}")
    return module


def _attr(gm: torch.nn.Module, target: str):
    obj = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj
