"""The minibatch the user gives: its size along dim 0, what `step` accepts, and its split into microbatches."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch.utils._pytree import tree_map

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


def check_step_tensors(named: Mapping[str, object], specs: tuple[InputSpec, ...], microbatches: int,
                       largest: int, smallest: int, call: str = "step") -> int:
    """Every tensor `call` (step, evaluate or predict: what the errors name) got is a tensor with data, all carry one batch along dim 0, and each has
    the example's dtype and sizes the stage code takes (`specs`, in the order of `named`; a plan saved
    before they were recorded has none). The batch splits into `microbatches` of `smallest` to
    `largest` samples (memory was planned for `largest`). Returns the batch size."""
    tensors: dict[str, torch.Tensor] = {}
    for name, value in named.items():
        if not isinstance(value, torch.Tensor):
            raise ExampleInputsError(f"{call} got a {type(value).__name__} for {name!r}; give a tensor, as in "
                                     "example_inputs / example_target")
        if value.is_meta:
            raise ExampleInputsError(f"{call} got {name!r} on the meta device (no data); give a tensor on 'cpu' or 'cuda'")
        tensors[name] = value
    batch = _common_batch(tensors, specs, call)
    _check_batch_size(batch, microbatches, largest, smallest, call)
    for index, (name, value) in enumerate(tensors.items()):
        if len(specs) == len(tensors):
            _check_like_example(name, value, specs[index], call)
    return batch


def _common_batch(named: dict[str, torch.Tensor], specs: tuple[InputSpec, ...], call: str) -> int:
    """The dim-0 size every batched tensor shares."""
    first: tuple[str, int] | None = None
    for index, (name, value) in enumerate(named.items()):
        spec = specs[index] if len(specs) == len(named) else None
        if not (spec.batched if spec is not None else value.dim() > 0):
            continue
        if value.dim() == 0:
            raise BatchSizeError(f"{call} got a 0-d tensor for {name!r}, which the example had batched along dim 0; "
                                 "give every input and the target the batch along dim 0")
        if first is None:
            first = (name, value.shape[0])
        elif value.shape[0] != first[1]:
            raise BatchSizeError(f"{call} got a batch of {value.shape[0]} for {name!r} but batches of {first[1]} for "
                                 f"{first[0]!r}; give every input and the target the same batch along dim 0")
    if first is None:
        raise BatchSizeError(f"{call} got no batched tensor: give the inputs with the batch along dim 0")
    return first[1]


def _check_batch_size(batch: int, microbatches: int, largest: int, smallest: int, call: str) -> None:
    """The batch splits into `microbatches` of `smallest` to `largest` samples (uneven: sizes differ by one)."""
    if -(-batch // microbatches) > largest:
        raise BatchSizeError(
            f"{call} got a batch of {batch}, but the pipeline was compiled for {microbatches} microbatches of "
            f"{largest} (a batch of at most {microbatches * largest}): its memory is planned for that; give "
            "smaller batches, or compile with example inputs of the largest batch")
    if batch // microbatches < smallest:
        fixed = smallest == largest
        reason = ("the traced graph fixed the microbatch size (torch.export could not keep it symbolic)" if fixed
                  else f"microbatches of fewer than {smallest} samples are not covered by the traced graph")
        raise BatchSizeError(
            f"{call} got a batch of {batch}, which splits into {microbatches} microbatches of {batch // microbatches} "
            f"or more samples, but {reason}; give a batch of {microbatches * smallest}"
            f"{'' if fixed else ' or more'} (e.g. DataLoader(drop_last=True)), or compile with fewer microbatches")


def _check_like_example(name: str, value: torch.Tensor, spec: InputSpec, call: str) -> None:
    if str(value.dtype) != spec.dtype:
        raise ExampleInputsError(f"{call} got {name!r} of dtype {value.dtype} but the example was {spec.dtype}; "
                                 f"convert it with .to({spec.dtype}) (or recompile with such examples)")
    shape = tuple(value.shape[1:] if spec.batched else value.shape)
    what = "sizes after the batch dimension" if spec.batched else "shape"
    lowest = spec.lowest or spec.shape
    if len(shape) != len(spec.shape) or any(s > most for s, most in zip(shape, spec.shape, strict=True)):
        raise ExampleInputsError(
            f"{call} got {name!r} with {what} {list(shape)} but the example had {list(spec.shape)}: the example's "
            "sizes are the largest the pipeline planned memory for; pad or crop to at most them, or compile with "
            "example inputs of the largest shape")
    if any(s < least for s, least in zip(shape, lowest, strict=True)):
        fixed = [i for i, (least, most) in enumerate(zip(lowest, spec.shape, strict=True)) if least == most]
        raise ExampleInputsError(
            f"{call} got {name!r} with {what} {list(shape)} but the traced graph takes at least {list(lowest)}"
            + (f" (it fixed the sizes of dimension(s) {[i + 1 for i in fixed]} at the example's)" if fixed else "")
            + "; pad to them")


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
    """The minibatch's inputs as `microbatches` slices along dim 0, in the same form: equal where the
    batch divides, else the first `batch % microbatches` one sample larger (torch.tensor_split)."""
    if isinstance(inputs, dict):
        chunks = {k: v.tensor_split(microbatches) if v.dim() else [v] * microbatches for k, v in inputs.items()}
        return [{k: c[i] for k, c in chunks.items()} for i in range(microbatches)]
    pieces = [v.tensor_split(microbatches) if v.dim() else [v] * microbatches for v in inputs]
    return [tuple(c[i] for c in pieces) for i in range(microbatches)]


def splits_evenly(inputs, microbatches: int) -> bool:
    """Whether `split_batch` gives every microbatch the same sizes: each tensor's dim 0 divides (or it
    has none), so one microbatch's sizes are every one's."""
    values = inputs.values() if isinstance(inputs, dict) else inputs
    return all(v.dim() == 0 or v.shape[0] % microbatches == 0 for v in values if isinstance(v, torch.Tensor))


def first_microbatch(target, microbatches: int):
    """The first of `microbatches` slices of the target (a scalar or None is every microbatch's)."""
    if isinstance(target, torch.Tensor) and target.dim() > 0:
        return target.tensor_split(microbatches)[0]
    return target


def on_model_device(model: torch.nn.Module, value):
    """The example's tensors where the model is, for tracing: data on the GPU beside a model still on
    the CPU (the usual order: the model is compiled before it is placed) traces like CPU data."""
    state: torch.Tensor | None = next(iter(model.parameters()), None)
    state = state if state is not None else next(iter(model.buffers()), None)
    device = state.device if state is not None else torch.device("cpu")
    return tree_map(lambda item: item.to(device) if isinstance(item, torch.Tensor) else item, value)
