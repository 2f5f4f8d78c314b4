"""The minibatch the user gives: its size along dim 0, and its split into equal microbatches."""

from __future__ import annotations

import torch

from stagewise.ir.errors import BatchSizeError, ExampleInputsError


def batch_size(example_inputs, example_target) -> int:
    """The one dim-0 size every input tensor and the target share."""
    values = list(example_inputs.values()) if isinstance(example_inputs, dict) else list(example_inputs)
    for value in values:
        if not isinstance(value, torch.Tensor):
            raise ExampleInputsError(
                f"example_inputs holds a {type(value).__name__}; stagewise needs tensors "
                "(drop None arguments, and pass Python constants through the model's config)"
            )
    if not values:
        raise ExampleInputsError("example_inputs is empty: give at least one input tensor")
    sizes = {v.shape[0] for v in values if v.dim() > 0}
    if isinstance(example_target, torch.Tensor) and example_target.dim() > 0:
        sizes.add(example_target.shape[0])
    if len(sizes) != 1:
        raise ExampleInputsError(
            f"inputs disagree on the batch size (dim 0 sizes {sorted(sizes)}); every input and the target "
            "must carry the batch along dim 0"
        )
    return sizes.pop()


def check_microbatches(batch: int, microbatches: int) -> None:
    if not isinstance(microbatches, int) or microbatches < 1:
        raise BatchSizeError(f"microbatches must be a positive int, got {microbatches!r}")
    if batch % microbatches:
        divisors = [d for d in range(1, batch + 1) if batch % d == 0]
        raise BatchSizeError(
            f"batch size {batch} is not divisible by microbatches={microbatches}; "
            f"use one of {divisors} microbatches or a batch size that is a multiple of {microbatches}"
        )


def split_batch(inputs, microbatches: int) -> list:
    """The minibatch's inputs as `microbatches` equal slices along dim 0, in the same form."""
    if isinstance(inputs, dict):
        chunks = {k: v.chunk(microbatches) if v.dim() else [v] * microbatches for k, v in inputs.items()}
        return [{k: c[i] for k, c in chunks.items()} for i in range(microbatches)]
    chunks = [v.chunk(microbatches) if v.dim() else [v] * microbatches for v in inputs]
    return [tuple(c[i] for c in chunks) for i in range(microbatches)]


def first_microbatch(target, microbatches: int):
    """The first of `microbatches` slices of the target (a scalar or None is every microbatch's)."""
    if isinstance(target, torch.Tensor) and target.dim() > 0:
        return target.chunk(microbatches)[0]
    return target
