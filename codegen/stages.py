"""One torch.fx.GraphModule per stage, cut out of the whole-model graph.

Node names come from the model (`transformer_h_3`, `blocks_1_attn_linear`), placeholders
are named after the values the stage receives, and parameters stay under their original
FQNs, so `stage.code` reads like hand-written code and `stage.state_dict()` keys match the
model's. Each stage gets its own copy of the state it uses; a tensor used twice inside one
stage (a tie that the partition did not split) stays one tensor there.
"""

from __future__ import annotations

import torch.fx as fx

from stagewise.ir.plan import Layer, Stage
from stagewise.ir.subgraph import extract


def build_stage_modules(gm: fx.GraphModule, layers: tuple[Layer, ...], stages: tuple[Stage, ...]) -> list[fx.GraphModule]:
    return [build_stage_module(gm, layers, stage) for stage in stages]


def build_stage_module(gm: fx.GraphModule, layers: tuple[Layer, ...], stage: Stage) -> fx.GraphModule:
    nodes = [name for i in stage.layers for name in layers[i].nodes]
    return extract(gm, nodes, stage.inputs, stage.outputs, class_name=f"Stage{stage.index}")
