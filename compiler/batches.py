"""The minibatch the user gives: its size along dim 0, and its split into equal microbatches."""

from __future__ import annotations

import torch

from stagewise.ir.errors import BatchSizeError, ExampleInputsError
from stagewise.ir.plan import InputSpec


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
    batch = sizes.pop()
    if batch < 1:
        raise BatchSizeError("example_inputs hold a batch of 0 samples; give at least one sample per microbatch "
                             "along dim 0")
    return batch


def input_specs(tensors: list[torch.Tensor]) -> tuple[InputSpec, ...]:
    """Each example tensor's dtype and non-batch sizes, for `step` to check its tensors against."""
    return tuple(InputSpec(str(t.dtype), tuple(t.shape[1:] if t.dim() else t.shape), t.dim() > 0) for t in tensors)


def check_step_tensors(named: dict[str, object], specs: tuple[InputSpec, ...], batch: int) -> None:
    """Every tensor `step` got is a tensor with data, carries `batch` samples along dim 0, and has
    the example's dtype and other sizes (`specs`, in the order of `named`; a plan saved before they
    were recorded has none)."""
    for name, value in named.items():
        if not isinstance(value, torch.Tensor):
            raise ExampleInputsError(f"step got a {type(value).__name__} for {name!r}; give a tensor, as in "
                                     "example_inputs / example_target")
        if value.is_meta:
            raise ExampleInputsError(f"step got {name!r} on the meta device (no data); give a tensor on 'cpu' or 'cuda'")
    for index, (name, value) in enumerate(named.items()):
        spec = specs[index] if len(specs) == len(named) else None
        batched = spec.batched if spec is not None else value.dim() > 0
        if batched and (value.dim() == 0 or value.shape[0] != batch):
            got = "a 0-d tensor" if value.dim() == 0 else f"a batch of {value.shape[0]}"
            raise BatchSizeError(f"step got {got} for {name!r} but the pipeline was compiled for batches of {batch}; "
                                 "give every input and the target the same batch along dim 0 (or recompile)")
        if spec is not None:
            _check_like_example(name, value, spec)


def _check_like_example(name: str, value: torch.Tensor, spec: InputSpec) -> None:
    if str(value.dtype) != spec.dtype:
        raise ExampleInputsError(f"step got {name!r} of dtype {value.dtype} but the example was {spec.dtype}; "
                                 f"convert it with .to({spec.dtype}) (or recompile with such examples)")
    shape = tuple(value.shape[1:] if spec.batched else value.shape)
    if shape != spec.shape:
        what = "sizes after the batch dimension" if spec.batched else "shape"
        raise ExampleInputsError(f"step got {name!r} with {what} {list(shape)} but the example had {list(spec.shape)}; "
                                 "the stages and their transfers are built for the example's sizes: pad or "
                                 "crop to them, or recompile with examples of the new size")


def check_microbatches(batch: int, microbatches: int) -> None:
    """`microbatches` divides the batch into equal microbatches."""
    if isinstance(microbatches, bool) or not isinstance(microbatches, int) or microbatches < 1:
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
