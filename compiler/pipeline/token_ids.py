"""Token ids an embedding cannot look up, named before a step, predict or evaluate runs.

An id at or above an embedding's size (or below 0) fails deep inside a stage as an IndexError (on
CUDA as a device-side assert that ends the process), after other stages may have started. The
stage graphs say which model input feeds an embedding directly, unchanged but for views (its
placeholder, then view / reshape / unsqueeze..., then the embedding's indices), and how many rows
that embedding has; those inputs' values are checked against it when the inputs are, so a bad
batch is refused before anything runs and the pipeline's state stays as it was.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from stagewise.ir.errors import ExampleInputsError
from stagewise.ir.plan import Plan
from stagewise.ir.subgraph import attribute

_aten = torch.ops.aten
_VIEWS = {_aten.view.default, _aten.reshape.default, _aten._unsafe_view.default, _aten.flatten.using_ints,
          _aten.contiguous.default, _aten.clone.default, _aten.alias.default, _aten.unsqueeze.default,
          _aten.squeeze.dim, _aten.expand.default, torch.flatten, torch.reshape, torch.unsqueeze}
_VIEW_METHODS = {"view", "reshape", "flatten", "contiguous", "unsqueeze", "squeeze", "expand", "long", "int"}


@dataclass(frozen=True)
class EmbeddingBound:
    """A model input whose values index an embedding of `rows` rows (the graph node `embedding`)."""

    input_name: str
    rows: int
    embedding: str


def embedding_bounds(plan: Plan, modules: Sequence[fx.GraphModule]) -> tuple[EmbeddingBound, ...]:
    """Every (model input, embedding) pair of these stage modules where the input's values are the ids."""
    names = dict(zip(plan.graph_inputs, plan.input_names, strict=False))
    bounds = []
    for module in modules:
        for node in module.graph.nodes:
            found = _indices_and_rows(module, node)
            if found is None:
                continue
            source = _through_views(found[0])
            if source is not None and source.op == "placeholder" and source.name in names:
                bounds.append(EmbeddingBound(names[source.name], found[1], node.name))
    return tuple(bounds)


def check_token_ids(inputs: dict[str, object], bounds: Sequence[EmbeddingBound], call: str) -> None:
    """ExampleInputsError naming the input, the id and the embedding's size where an id is out of range."""
    for bound in bounds:
        value = inputs.get(bound.input_name)
        if not isinstance(value, torch.Tensor) or value.is_meta or value.is_floating_point() or value.numel() == 0:
            continue
        low, high = int(value.min()), int(value.max())
        if low < 0 or high >= bound.rows:
            bad = low if low < 0 else high
            raise ExampleInputsError(
                f"{call} got {bound.input_name!r} holding the id {bad}, but it indexes an embedding of {bound.rows} "
                f"rows ({bound.embedding}: ids 0 to {bound.rows - 1}); use a tokenizer of the model's vocabulary "
                "(or resize the model's embeddings and compile it again)")


def _indices_and_rows(module: fx.GraphModule, node: fx.Node) -> tuple[fx.Node, int] | None:
    """The indices node of an embedding lookup and its table's rows, for fx's leaf, F.embedding and ATen's."""
    if node.op == "call_module":
        leaf = module.get_submodule(str(node.target))
        if isinstance(leaf, nn.Embedding) and node.args and isinstance(node.args[0], fx.Node):
            return node.args[0], leaf.num_embeddings
        return None
    if node.op != "call_function" or node.target not in (_aten.embedding.default, F.embedding):
        return None
    weight, indices = node.args[:2] if node.target is _aten.embedding.default else node.args[1::-1]
    if not isinstance(indices, fx.Node) or not isinstance(weight, fx.Node) or weight.op != "get_attr":
        return None
    table = attribute(module, str(weight.target))
    return (indices, table.shape[0]) if isinstance(table, torch.Tensor) and table.dim() == 2 else None


def _through_views(node: fx.Node) -> fx.Node | None:
    """The node whose values `node` holds unchanged (through views and reshapes), or None past any other op."""
    while node.op != "placeholder":
        viewing = (node.op == "call_function" and node.target in _VIEWS) or (
            node.op == "call_method" and node.target in _VIEW_METHODS)
        if not viewing or not node.args or not isinstance(node.args[0], fx.Node):
            return None
        node = node.args[0]
    return node
