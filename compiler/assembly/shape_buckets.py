"""`shape_buckets=`: a step's sequences padded up to one of a few lengths, so a loader of many lengths
runs a handful of shapes (each sized once, compiler/assembly/step_shapes.py) instead of one per length.

Padding is allowed only where it leaves the loss and gradients those of the unpadded batch: the
targets (or a Hugging Face model's `labels`) are padded with the loss's ignore index, an attention
mask with 0 (masked), every other input with 0; compile checks on the example that the loss does
not change (compiler/compile/padding_check.py) and refuses, naming the input, where it would.
Sequences are padded at the end (right padding), along dimension 1 of every input whose example
has the first input's length there.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from stagewise.compiler.assembly.loss_reduction import IGNORE_INDEX, LossReduction, TokenMean
from stagewise.ir.errors import OptionError

SEQUENCE_DIM = 1  # (batch, sequence, ...): what is padded
FIX = "e.g. shape_buckets=16 (lengths padded up to a multiple of 16) or shape_buckets=(32, 64, 128)"


@dataclass(frozen=True)
class ShapeBuckets:
    """The lengths a sequence may be padded to: a multiple of `multiple`, or the smallest of `sizes`
    at least as long; never beyond the example's length (the longest a step may give)."""

    multiple: int | None = None
    sizes: tuple[int, ...] = ()

    def bucket(self, length: int, longest: int) -> int:
        """The length a sequence of `length` is padded to."""
        if self.multiple is not None:
            return min(math.ceil(length / self.multiple) * self.multiple, longest)
        return min((size for size in self.sizes if size >= length), default=longest)


def parse_shape_buckets(value: object) -> ShapeBuckets | None:
    """compile's `shape_buckets=`: None, a positive int (a multiple) or a list / tuple of positive lengths."""
    if value is None or isinstance(value, ShapeBuckets):
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 1:
            raise OptionError(f"shape_buckets={value!r} must be a positive multiple to pad lengths up to; {FIX}")
        return ShapeBuckets(multiple=value)
    if isinstance(value, list | tuple) and value:
        if not all(isinstance(size, int) and not isinstance(size, bool) and size >= 1 for size in value):
            raise OptionError(f"shape_buckets={value!r} must list positive int lengths; {FIX}")
        if len(set(value)) != len(value):
            raise OptionError(f"shape_buckets={value!r} lists a length twice; give each once, {FIX}")
        return ShapeBuckets(sizes=tuple(sorted(value)))
    raise OptionError(f"shape_buckets={value!r} is neither a multiple (an int) nor a list of lengths; {FIX}")


@dataclass(frozen=True)
class Padding:
    """How a step's inputs (by name, the target's included) are padded: each padded input's fill,
    up to the bucket of the sequence's length."""

    buckets: ShapeBuckets
    longest: int  # the example's sequence length
    fills: dict[str, int | float]  # padded input -> the value its padding holds
    labels: frozenset[str] = frozenset()  # the padded inputs holding targets (filled with the ignore index)

    def padded(self, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """`inputs` with every padded input padded at the end of its sequence to the bucket. Inputs
        whose lengths disagree are left as given (the step refuses them, naming the sizes)."""
        lengths = {inputs[name].shape[SEQUENCE_DIM] for name in self.fills if inputs[name].dim() > SEQUENCE_DIM}
        if len(lengths) != 1:
            return inputs
        length = lengths.pop()
        extra = self.buckets.bucket(length, self.longest) - length
        if extra <= 0:
            return inputs
        return {name: _pad(value, extra, self.fills[name]) if name in self.fills else value
                for name, value in inputs.items()}


def padding_to_data(padding: Padding | None) -> dict | None:
    """What a checkpoint keeps of compile's shape_buckets (training.pt), so that a loaded pipeline pads
    its steps as the saved one did (it padded nothing before, each new length a new shape)."""
    if padding is None:
        return None
    return {"multiple": padding.buckets.multiple, "sizes": list(padding.buckets.sizes), "longest": padding.longest,
            "fills": dict(padding.fills), "labels": sorted(padding.labels)}


def padding_from_data(data: dict | None) -> Padding | None:
    """What `padding_to_data` wrote, once compiler/checkpoint/training_file.py has checked it."""
    if data is None:
        return None
    return Padding(ShapeBuckets(data["multiple"], tuple(data["sizes"])), data["longest"], dict(data["fills"]),
                   frozenset(data["labels"]))


def padding_of(buckets: ShapeBuckets, example: dict[str, torch.Tensor], target_name: str | None,
               reduction: LossReduction | None) -> Padding:
    """The padding of compile's example (input name, then the target's, -> tensor): the inputs whose
    dimension 1 is the first input's length, each with its fill. Raises OptionError for buckets
    longer than the example's sequence or an example without one."""
    longest = sequence_length(buckets, *next(iter(example.items())))
    ignored = reduction.ignore_index if isinstance(reduction, TokenMean) else IGNORE_INDEX
    labels = {name for name in (target_name, reduction.labels if reduction is not None else None) if name is not None}
    fills = {name: _fill(name, value, labels, ignored) for name, value in example.items()
             if value.dim() > SEQUENCE_DIM and value.shape[SEQUENCE_DIM] == longest}
    return Padding(buckets, longest, fills, frozenset(labels & set(fills)))


def sequence_length(buckets: ShapeBuckets, name: str, first: object) -> int:
    """The example's sequence length: dimension 1 of its first input (`name`), which must have one,
    as long as every listed bucket. Raises OptionError (compile calls it before the phases run)."""
    if not isinstance(first, torch.Tensor) or first.dim() <= SEQUENCE_DIM:
        shape = list(first.shape) if isinstance(first, torch.Tensor) else type(first).__name__
        raise OptionError(f"shape_buckets pads dimension {SEQUENCE_DIM} (the sequence), but input {name!r} is "
                          f"{shape}: drop shape_buckets")
    longest = first.shape[SEQUENCE_DIM]
    beyond = [size for size in buckets.sizes if size > longest]
    if beyond:
        raise OptionError(f"shape_buckets lists {beyond}, longer than the example's sequence ({longest}), the longest "
                          "a step may give: drop them, or compile with a longer example")
    return longest


def _fill(name: str, value: torch.Tensor, labels: set[str], ignored: int) -> int | float:
    """Targets hold the loss's ignore index, everything else 0 (an attention mask's 'masked')."""
    if name in labels:
        return ignored
    return 0.0 if value.is_floating_point() else 0


def _pad(value: torch.Tensor, extra: int, fill: int | float) -> torch.Tensor:
    """`value` with `extra` entries of `fill` after its sequence (dimension 1)."""
    widths = [0, 0] * (value.dim() - SEQUENCE_DIM - 1) + [0, extra]
    return F.pad(value, widths, value=fill)
