"""`pipe.predict`'s result: what the model returns, put together from the microbatches' tensors.

The plan keeps the structure of the model's output as pytree JSON and, per leaf, the node that
computes it (passes/model_output.py). The structure is read back with torch's `treespec_loads`,
which names only types registered with torch's pytree in this process (a Hugging Face ModelOutput
registers itself when its module is imported): reading it imports and runs nothing. Each leaf is
its node's microbatches concatenated along dim 0; a leaf without a node (a cache, the model's own
loss, a tensor the loss did not need) or of no batch dimension (0-d) is None, and a container left with no tensor at all is None
too (a ModelOutput leaves None fields out, as the model does without labels).
"""

from __future__ import annotations

import torch
from torch.utils import _pytree as pytree

from stagewise.ir.errors import PredictError
from stagewise.ir.plan import Plan


def model_output(plan: Plan, pieces: dict[str, dict[int, torch.Tensor]], microbatches: int, samples: int) -> object:
    """The model's output of the batch's first `samples` samples, from each output node's microbatches."""
    tensors = {name: _concatenated(name, by_mb, microbatches, samples) for name, by_mb in pieces.items()}
    if plan.output_spec is None:  # a plan saved before its output's structure was kept: one tensor
        if len(tensors) != 1:
            raise PredictError("this checkpoint does not record the structure of the model's output (saved by an "
                               "older stagewise): compile the model again (and pipe.restore the checkpoint) to predict")
        return next(iter(tensors.values()))
    spec = _structure(plan.output_spec)
    if len(plan.output_nodes) != spec.num_leaves:
        raise PredictError(f"the plan names {len(plan.output_nodes)} nodes for the {spec.num_leaves} values of the "
                           "model's output: the checkpoint is damaged; save it again from a compiled pipeline")
    leaves = [tensors.get(name) if isinstance(name, str) else None for name in plan.output_nodes]
    return _rebuilt(spec, iter(leaves))


def _concatenated(name: str, by_mb: dict[int, torch.Tensor], microbatches: int, samples: int) -> torch.Tensor | None:
    """The node's microbatches along dim 0, the first `samples`; None for a 0-d value (one per microbatch,
    such as an auxiliary loss: the batch's is not theirs to tell)."""
    missing = [mb for mb in range(microbatches) if mb not in by_mb]
    if missing:
        raise PredictError(f"no stage returned {name!r} of the model's output for microbatches {missing}: the stage "
                           "code does not match the plan; compile the model again")
    parts = [by_mb[mb] for mb in range(microbatches)]
    return torch.cat(parts)[:samples] if parts[0].dim() else None


def _structure(described: str) -> pytree.TreeSpec:
    """The output's pytree structure from the plan's JSON; PredictError naming what this process lacks."""
    try:
        return pytree.treespec_loads(described)
    except NotImplementedError as error:  # a type no module of this process registered
        raise PredictError(f"the model's output is of a type this process does not know ({error}); import the "
                           "module defining it (for a Hugging Face model: its transformers class) before "
                           "pipe.predict") from None
    except (ValueError, TypeError, KeyError, IndexError) as error:
        raise PredictError(f"the plan's description of the model's output is not pytree JSON ({error}): the "
                           "checkpoint is damaged; save it again from a compiled pipeline") from None


def _rebuilt(spec: pytree.TreeSpec, leaves) -> object:
    """`spec` filled from `leaves`; a subtree holding no tensor is None (a Hugging Face cache left out)."""
    if spec.is_leaf():
        return next(leaves)
    children = [_rebuilt(child, leaves) for child in spec.children()]
    if all(child is None for child in children) and spec.type not in (tuple, list):
        return None
    return pytree.SUPPORTED_NODES[spec.type].unflatten_fn(children, spec.context)
