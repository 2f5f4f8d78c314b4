"""A step's minibatch made ready for the workers: named, checked, split, weighed and its transfers sized.

One compiled pipeline takes any batch the stage code takes: a batch that does not divide into the
microbatches is split unevenly (the first `batch % microbatches` one sample larger), non-batch sizes
may shrink down to what the traced graph covers, and the example's sizes are the largest (memory
was planned for them). Each microbatch's loss weighs its share of the batch (its samples, or the
counted items of a loss reduction), so the step's loss and gradients are eager's on the whole
batch; targets padded with -100 that no reduction counts are warned about once (they would make
the step a mean of microbatch means); transfers of microbatches shaped unlike the example are
sized ahead (compiler/assembly/step_shapes.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from stagewise.compiler.assembly.batches import check_step_tensors, split_batch, splits_evenly
from stagewise.compiler.assembly.loss_reduction import LossReduction, loss_weights
from stagewise.compiler.assembly.shape_buckets import Padding
from stagewise.compiler.assembly.step_shapes import StepShapes, TransferSpecs
from stagewise.compiler.pipeline.step_notices import StepNotices
from stagewise.ir.errors import ExampleInputsError
from stagewise.ir.plan import Plan


@dataclass(frozen=True)
class PreparedBatch:
    """Per microbatch the graph inputs (node name -> tensor); the loss weights (None: 1 / microbatches,
    the batch divided evenly); the transfers' sizes where the microbatches differ from the example."""

    pieces: list[dict[str, torch.Tensor]]
    weights: tuple[float, ...] | None
    transfer_specs: TransferSpecs | None


def prepare_batch(plan: Plan, shapes: StepShapes, inputs: dict[str, torch.Tensor],
                  reduction: LossReduction | None, notices: StepNotices, call: str = "step",
                  padding: Padding | None = None) -> PreparedBatch:
    """`inputs` (model input name, then the target's, -> tensor) checked, padded (compile's
    shape_buckets) and split for a step (or the `call` its errors name: evaluate)."""
    m = plan.microbatches
    batch = check_step_tensors(inputs, plan.input_specs, m, plan.microbatch_size,
                               plan.smallest_microbatch or plan.microbatch_size, call)
    if reduction is None:
        notices.padding_uncounted(inputs, plan.target_name)  # the user's padding, not the buckets'
    if padding is not None:
        inputs = padding.padded(inputs)
    node_names = dict(zip(plan.input_names + (plan.target_name,), plan.graph_inputs, strict=False))
    split = split_batch(inputs, m)
    if reduction is not None:
        weights: tuple[float, ...] | None = loss_weights(reduction, split, plan.target_name)
    elif batch % m:
        weights = tuple(len(piece) / batch for piece in torch.arange(batch).tensor_split(m))
    else:
        weights = None
    pieces = [{node_names[k]: v for k, v in piece.items()} for piece in split]
    return PreparedBatch(pieces, weights, shapes.of_step(pieces, alike=splits_evenly(inputs, m)))


def training_inputs(plan: Plan, args, target, kwargs, call: str = "step") -> dict:
    """The arguments of `call` (step, evaluate) by input name, then the target under its name, checked."""
    inputs = named_inputs(plan, args, kwargs, call)
    if plan.target_name is not None:
        if target is None:
            raise ExampleInputsError(f"this pipeline was compiled with loss_fn: call {call}(..., target=targets)")
        inputs[plan.target_name] = target
    elif target is not None:
        raise ExampleInputsError(f"{call} got target= but the pipeline was compiled without loss_fn (the model "
                                 "returns its loss): drop target=, or recompile with loss_fn and example_target")
    return inputs


def named_inputs(plan: Plan, args, kwargs, call: str = "step") -> dict:
    """`call`'s arguments (step, evaluate, predict) by input name, as the example gave them (positional
    or keyword), checked."""
    names = plan.input_names
    if plan.input_kind == "positional":
        if kwargs or len(args) != len(names):
            raise ExampleInputsError(
                f"{call} takes {len(names)} positional inputs ({', '.join(names)}) as in example_inputs, "
                f"got {len(args)} positional and {sorted(kwargs)} keyword"
            )
        inputs = dict(zip(names, args, strict=True))
    else:
        if args or set(kwargs) != set(names):
            raise ExampleInputsError(
                f"{call} takes keyword inputs {sorted(names)} as in example_inputs, got {len(args)} positional "
                f"and {sorted(kwargs)} keyword"
            )
        inputs = {n: kwargs[n] for n in names}
    for name, value in inputs.items():
        if not isinstance(value, torch.Tensor):
            raise ExampleInputsError(f"every input to {call} must be a tensor, as in example_inputs; "
                                     f"{name!r} is a {type(value).__name__}")
    return inputs
