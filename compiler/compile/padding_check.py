"""Compile's check that `shape_buckets` padding leaves the loss of a batch unchanged, on the example.

Padding is exact where nothing reads the padded positions: a causal model's real positions never
see later ones, an attention mask hides them from a bidirectional one, and the loss skips targets
of its ignore index. Whether that holds is a property of the model and the loss that no option
states, so it is measured: the example's first samples, cut shorter, give the eager loss unpadded,
padded with the fills and padded with other content in each input; any difference refuses the
option naming the input whose padding is read (or the targets, or the length itself). Padded
content that is never read leaves the loss bitwise the same (the same shapes run the same
kernels, and masked positions weigh exactly 0), so that comparison is exact: a small random model
reading one padded position moves its loss by 1e-6 only. Unpadded and padded shapes differ, so
those two losses are compared within rounding. Dropout is
left out of the check (its draws differ per shape by design); BatchNorm's buffers are not updated.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from stagewise.compiler.assembly.loss_reduction import LossReduction
from stagewise.compiler.assembly.shape_buckets import SEQUENCE_DIM, Padding, ShapeBuckets, padding_of
from stagewise.ir.errors import OptionError
from stagewise.passes.capture import Capture

SAMPLES = 2  # of the example's, enough to see padding read and cheap at any model size
RTOL, ATOL = 1e-4, 1e-6  # rounding of the same sums in other shapes, far below what read padding changes


def check_padding(capture: Capture, padding: Padding, example: dict[str, torch.Tensor]) -> None:
    """Raises OptionError where padding the example (input name -> tensor, the target's included)
    changes its loss."""
    length = next((n for n in range(padding.longest - 1, 1, -1) if padding.buckets.bucket(n, padding.longest) > n), None)
    if length is None:
        return  # every length is its own bucket: nothing is ever padded
    short = {name: value[:SAMPLES].narrow(SEQUENCE_DIM, 0, length).contiguous() if name in padding.fills
             else value[:SAMPLES] for name, value in example.items()}
    try:
        _compare(capture, padding, short, length)
    except OptionError:
        raise
    except Exception as error:  # noqa: BLE001 - the model or loss refusing the padded batch refuses the option
        raise OptionError(f"shape_buckets pads {sorted(padding.fills)} along dimension {SEQUENCE_DIM}, and the model "
                          f"or loss fails on the padded example ({type(error).__name__}: {error}); drop "
                          "shape_buckets") from error


def _compare(capture: Capture, padding: Padding, short: dict[str, torch.Tensor], length: int) -> None:
    """The loss of `short` unpadded, padded, and padded with other content in each input, compared."""
    padded = padding.padded(short)
    with _without_dropout(capture.objective), torch.no_grad():
        unpadded_loss = _loss(capture, short)
        padded_loss = _loss(capture, padded)
        for name in _readable(padding):
            other = _loss(capture, {**padded, name: _other_padding(padded[name], length, short[name])})
            if not torch.equal(other, padded_loss):
                raise OptionError(f"shape_buckets pads input {name!r}, and the model reads its padding (the loss "
                                  f"changes from {float(padded_loss):.6g} to {float(other):.6g} with other padded "
                                  "content): give the model an attention mask input (attention_mask=, padded with 0) "
                                  "or drop shape_buckets")
    if not _same(padded_loss, unpadded_loss):
        counted = sorted(padding.labels)
        reason = (f"the loss counts the padding of {counted} (filled with the ignore index "
                  f"{[padding.fills[name] for name in counted]}: give a loss that ignores it, e.g. cross_entropy's "
                  "ignore_index) or the model depends on the length itself" if counted
                  else "the model depends on the length itself")
        raise OptionError(f"shape_buckets padding changes the loss ({float(unpadded_loss):.6g} unpadded, "
                          f"{float(padded_loss):.6g} padded) though no input's padded content is read: {reason}; "
                          "drop shape_buckets")


def _readable(padding: Padding) -> list[str]:
    """The padded inputs whose content the model should not read: all but the targets and attention
    masks (whose 0 is their meaning)."""
    return [name for name in padding.fills if name not in padding.labels and "mask" not in name]


def _other_padding(value: torch.Tensor, length: int, real: torch.Tensor) -> torch.Tensor:
    """`value` with its padding (positions from `length` on) replaced by other content of its kind:
    values drawn from its real part (valid token ids), or noise for floats."""
    changed = value.clone()
    pad = changed.narrow(SEQUENCE_DIM, length, value.shape[SEQUENCE_DIM] - length)
    generator = torch.Generator().manual_seed(0)
    if value.is_floating_point():
        pad.copy_(torch.randn(pad.shape, generator=generator, dtype=value.dtype))
    else:
        pool = real.flatten()
        pad.copy_(pool[torch.randint(0, pool.numel(), pad.shape, generator=generator)])
    return changed


def _loss(capture: Capture, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """The eager loss of `inputs` (by name), BatchNorm's buffers left as they were."""
    objective = capture.objective
    target = inputs.get(capture.target_name) if capture.target_name is not None else None
    model_inputs = {name: inputs[name] for name in capture.input_names}
    given = model_inputs if capture.input_kind == "keyword" else tuple(model_inputs.values())
    buffers = {name: buffer.clone() for name, buffer in objective.named_buffers()}
    args = (given, target) if target is not None else (given,)
    return torch.func.functional_call(objective, buffers, args)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(torch.allclose(a.float(), b.float(), rtol=RTOL, atol=ATOL))


@contextlib.contextmanager
def _without_dropout(module: torch.nn.Module) -> Iterator[None]:
    """Dropout modules in eval mode for the check (their draws differ per shape), restored after."""
    dropouts = [m for m in module.modules() if isinstance(m, torch.nn.modules.dropout._DropoutNd) and m.training]
    for dropout in dropouts:
        dropout.eval()
    try:
        yield
    finally:
        for dropout in dropouts:
            dropout.train()


def bucket_padding(capture: Capture, buckets: ShapeBuckets, inputs, target: torch.Tensor | None,
                   reduction: LossReduction | None) -> Padding:
    """The padding of compile's example `inputs` (a tuple or dict, on the model's device) and `target`
    under `buckets`, checked: raises OptionError where it would change the loss."""
    values = inputs.values() if isinstance(inputs, dict) else inputs
    example = dict(zip(capture.input_names, values, strict=True))
    if capture.target_name is not None and target is not None:
        example[capture.target_name] = target
    padding = padding_of(buckets, example, capture.target_name, reduction)
    check_padding(capture, padding, example)
    return padding
