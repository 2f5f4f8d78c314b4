"""A batch too small for the pipeline's microbatches, repeated whole to fill them (`predict`, `evaluate`).

A pipeline runs `plan.microbatches` microbatches of at least its smallest microbatch (the traced
graph covers no fewer samples), so a step needs a batch of at least their product. predict and
evaluate compute in eval mode, where each sample's output and loss are its own (dropout off,
BatchNorm on its running statistics), so a smaller batch (one sample, to predict interactively) is
repeated whole until every microbatch is full enough: predict keeps the first copy's outputs, and
evaluate's loss, each microbatch weighed by its share of the samples (or of the counted items of a
loss reduction), is the mean over equal copies: the batch's own. `step` is never filled: repeated
samples would weigh twice in its gradients.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from stagewise.ir.plan import Plan


@dataclass
class GivenSamples:
    """How many samples the caller gave, once the inputs are read (under torch.distributed, when the pass begins)."""

    count: int = 0


def filled(plan: Plan, inputs: dict[str, Any], given: GivenSamples | None = None) -> dict[str, Any]:
    """`inputs` (by name, in `plan.input_specs` order) with every batched tensor repeated whole as often
    as the microbatches need; as given where they are full enough, or disagree on the batch (`step`'s
    checks then name the problem), or repeating would exceed the largest microbatch."""
    batched = [name for index, (name, value) in enumerate(inputs.items())
               if isinstance(value, torch.Tensor) and _batched(plan, index, value)]
    sizes = {inputs[name].shape[0] for name in batched}  # type: ignore[union-attr]
    if len(sizes) != 1:
        return inputs
    batch = sizes.pop()
    if given is not None:
        given.count = batch
    times = _repeats(batch, plan.microbatches, plan.smallest_microbatch or plan.microbatch_size, plan.microbatch_size)
    if times == 1:
        return inputs
    return {name: _repeated(value, times) if name in batched else value  # type: ignore[arg-type]
            for name, value in inputs.items()}


def _batched(plan: Plan, index: int, value: torch.Tensor) -> bool:
    """Whether the input at `index` carries the batch along dim 0 (as the example did)."""
    if index < len(plan.input_specs):
        return plan.input_specs[index].batched and value.dim() > 0
    return value.dim() > 0


def _repeats(batch: int, microbatches: int, smallest: int, largest: int) -> int:
    """How many whole copies of a batch fill `microbatches` of `smallest` to `largest` samples (1: as it is)."""
    if batch < 1 or batch // microbatches >= smallest:
        return 1
    times = -(-microbatches * smallest // batch)
    return times if -(-times * batch // microbatches) <= largest else 1


def _repeated(value: torch.Tensor, times: int) -> torch.Tensor:
    return value.repeat(times, *[1] * (value.dim() - 1))
