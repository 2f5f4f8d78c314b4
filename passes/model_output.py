"""What the model's forward returns, as `pipe.predict` gives it back: its structure and where its tensors are.

A model returns a tensor, a tuple, a dict or a Hugging Face ModelOutput; a loss function reads
part of it (`out.logits`). The capture flattens that output (torch.utils._pytree) and marks the
node of each of its tensors with the tensor's ordinal (`OUTPUT_LEAF`, beside `MODEL_OUTPUT`,
which the stage code keeps when saved). The plan keeps the structure as pytree JSON and, per
leaf, the name of the graph node computing it (node names survive codegen and saving); predict
fills the structure with each node's microbatches concatenated. A leaf the graph does not keep
(not a tensor, such as a key/value cache; a tensor the loss does not need, removed as dead code;
the model's own loss, which needs the labels predict does not take) has no node.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx
from torch.utils._pytree import TreeSpec, tree_flatten, treespec_dumps

from stagewise.ir.subgraph import MODEL_OUTPUT

OUTPUT_LEAF = "stagewise_output_leaf"  # node meta: the ordinals of the model output's tensors it computes


@dataclass(frozen=True)
class OutputStructure:
    """The model output's pytree structure and, per ordinal of its marked tensors, their leaf position."""

    spec: TreeSpec
    positions: tuple[int, ...]

    def described(self) -> str | None:
        """The structure as pytree JSON (what the plan keeps); None for a type pytree cannot name."""
        try:
            return treespec_dumps(self.spec)
        except (NotImplementedError, TypeError, ValueError):
            return None

    def node_names(self, gm: fx.GraphModule) -> tuple[str | None, ...]:
        """Per leaf of the structure, the name of the node of `gm` computing it (None: not in the graph)."""
        names: list[str | None] = [None] * self.spec.num_leaves
        for node in gm.graph.nodes:
            for ordinal in node.meta.get(OUTPUT_LEAF, ()):
                names[self.positions[ordinal]] = node.name
        return tuple(names)


def flatten_output(output, own_loss) -> tuple[OutputStructure, list]:
    """The structure of `output` and its tensors (fx proxies while fx traces) other than `own_loss`."""
    leaves, spec = tree_flatten(output)
    tensors = [(position, leaf) for position, leaf in enumerate(leaves)
               if isinstance(leaf, torch.Tensor | fx.Proxy) and leaf is not own_loss]
    return OutputStructure(spec, tuple(position for position, _ in tensors)), [leaf for _, leaf in tensors]


def mark_output(node: fx.Node, ordinal: int) -> None:
    """Mark `node` as computing the model output's tensor of this ordinal (a node may compute several)."""
    node.meta[MODEL_OUTPUT] = True
    node.meta[OUTPUT_LEAF] = (*node.meta.get(OUTPUT_LEAF, ()), ordinal)
