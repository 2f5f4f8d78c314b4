"""What a checkpoint would run, rebuilt and checked before any of it runs.

Why: every name in a checkpoint's data becomes code that runs (a stage's calls, a leaf module's
class, the optimizer's class), and an attacker can rewrite every file, the marker included. So
every stage structure (stage_<i>.json), the whole graph (graph.json, which a re-plan runs and
the next save writes again) and the optimizer class (training.pt) are resolved through the
allowlist and the caller's trusted functions (codegen/allowlist.py) and built on the meta
device, before anything runs. `sw.load` and `stagewise inspect` call this one function, so
inspect refuses what load refuses and shows the code load would run: the code torch.fx generates
for the rebuilt graphs, never the saved stage_<i>.py text.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch.fx as fx

from stagewise.codegen.graph_data import build_stage
from stagewise.compiler.assembly.optimizer_recipe import recorded_class
from stagewise.compiler.checkpoint.read import Checkpoint
from stagewise.compiler.checkpoint.write import GRAPH_FILE
from stagewise.ir.errors import CheckpointError


@dataclass(frozen=True)
class Rebuilt:
    """A checkpoint's modules on the meta device (no weights), every name in them resolved."""

    stages: list[fx.GraphModule]  # one per stage of the saved plan
    graph: fx.GraphModule | None  # graph.json's whole graph; None where the checkpoint keeps none


def rebuild_checkpoint(saved: Checkpoint, trusted: Mapping[str, Callable]) -> Rebuilt:
    """Every stage, the saved graph and the optimizer class resolved from `saved` ({"module.qualname":
    function} trusted); a CheckpointError names the file and the entry it refuses."""
    stages = [_built(saved, f"stage_{stage.index}.json", structure, f"Stage{stage.index}", trusted)
              for stage, structure in zip(saved.plan.stages, saved.structures, strict=True)]
    model_graph = saved.model_graph
    graph = None
    if isinstance(model_graph, dict) and "graph" in model_graph:
        graph = _built(saved, GRAPH_FILE, model_graph["graph"], _class_name(model_graph.get("model")), trusted)
    recipe = saved.training.get("optimizer")
    if isinstance(recipe, dict) and "class" in recipe:
        try:
            recorded_class(recipe["class"], trusted)
        except CheckpointError as error:
            raise type(error)(f"{saved.root}: {error}") from None  # an UntrustedCodeError stays one
    return Rebuilt(stages, graph)


def _built(saved: Checkpoint, name: str, structure: object, class_name: str, trusted: Mapping[str, Callable]
           ) -> fx.GraphModule:
    """One structure built on the meta device; a refusal names its file."""
    try:
        return build_stage(structure, class_name, trusted)  # type: ignore[arg-type]  # build_stage checks it
    except CheckpointError as error:
        raise type(error)(f"{saved.root / name} is whole but cannot be used: {error}") from None


def _class_name(saved_name: object) -> str:
    """The rebuilt graph's class name: the model's, where it is a plain name (it is only displayed)."""
    return saved_name if isinstance(saved_name, str) and saved_name.isidentifier() else "Model"
