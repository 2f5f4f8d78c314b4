"""How the loss reduces over the batch, so a step equals eager training on the whole batch.

The model or `loss_fn` gives each microbatch its own mean. Averaging those means is exact only
when every microbatch counts the same number of items; with padding (targets of `ignore_index`)
the eager loss is the mean over every counted item of the batch. Declared with
`compile(..., loss_reduction=TokenMean(...))`, each microbatch's mean is weighted by its share of
the batch's counted items, read from the targets before the step runs: the backward's seed and
the reported loss use that weight instead of 1 / microbatches.

A Hugging Face model given `labels` needs no declaration (`model_reduction`): its loss is the
token mean its Trainer makes exact by passing the whole batch's count as `num_items_in_batch`;
weighing each microbatch's mean by its share of that count is the same sum over the same
divisor. Where no reduction is known and the targets hold -100, the step warns
(`padding_without_reduction`): the mean of microbatch means is then not eager's.
"""

from __future__ import annotations

import inspect
import sys
from dataclasses import asdict, dataclass

import torch

from stagewise.ir.errors import LossError

IGNORE_INDEX = -100  # what cross_entropy and every Hugging Face loss leave out by default


@dataclass(frozen=True)
class TokenMean:
    """The loss is a mean over the target entries that are not `ignore_index` (cross_entropy's
    default). `labels` names the model input holding them when the model returns its own loss
    (Hugging Face `labels=`); `shift` drops each row's first label, as a causal LM's loss does.
    Pass it as compile's `loss_reduction=` so a step with padded targets equals eager's on the
    whole batch: each microbatch's mean is weighted by its share of the counted entries.

    Args:
        ignore_index: the target value the loss leaves out (-100, as cross_entropy's default).
        labels: the model input holding the targets, for a model that returns its own loss; None
            for compile's `example_target`.
        shift: whether the loss drops each row's first label (a causal LM's next-token loss).

    Example:
        >>> sw.TokenMean(labels="labels", shift=True)
        TokenMean(ignore_index=-100, labels='labels', shift=True)
    """

    ignore_index: int = IGNORE_INDEX
    labels: str | None = None
    shift: bool = False

    def count(self, labels: torch.Tensor) -> int:
        """How many entries of one microbatch's labels the loss counts.

        Args:
            labels: the microbatch's targets, samples along dim 0.

        Returns:
            The entries that are not `ignore_index` (after the shift, if any).

        Example:
            >>> sw.TokenMean().count(torch.tensor([[5, 1, -100], [2, -100, -100]]))
            3
            >>> sw.TokenMean(shift=True).count(torch.tensor([[5, 1, -100], [2, -100, -100]]))
            1
        """
        kept = labels[:, 1:] if self.shift else labels
        return int((kept != self.ignore_index).sum())


@dataclass(frozen=True)
class SampleMean:
    """The loss is a mean over the samples (dim 0) of the target, or of `labels` (a model input).
    Pass it as compile's `loss_reduction=` so that a last microbatch smaller than the others
    (a batch that does not divide) weighs by its samples, as in eager training.

    Args:
        labels: the model input whose samples count, for a model that returns its own loss; None
            for compile's `example_target`.

    Example:
        >>> sw.SampleMean()
        SampleMean(labels=None)
    """

    labels: str | None = None

    def count(self, labels: torch.Tensor) -> int:
        """How many samples one microbatch's loss averages over.

        Args:
            labels: the microbatch's targets.

        Returns:
            Their size along dim 0 (1 for a 0-d target).

        Example:
            >>> sw.SampleMean().count(torch.zeros(3, 7))
            3
        """
        return int(labels.shape[0]) if labels.dim() else 1


LossReduction = TokenMean | SampleMean


def reduction_to_data(reduction: LossReduction | None) -> dict | None:
    """The reduction as plain values (a checkpoint holds no classes)."""
    if reduction is None:
        return None
    return {"kind": type(reduction).__name__, **asdict(reduction)}


def reduction_from_data(data: dict | None) -> LossReduction | None:
    """What `reduction_to_data` wrote."""
    if data is None:
        return None
    fields = {k: v for k, v in data.items() if k != "kind"}
    return TokenMean(**fields) if data["kind"] == "TokenMean" else SampleMean(**fields)


def check_loss_reduction(reduction: object, has_loss_fn: bool, inputs: list[str]) -> None:
    """A known reduction, with its counts readable: from the target with loss_fn, else from the
    model input named by `labels`."""
    if reduction is None:
        return
    if not isinstance(reduction, TokenMean | SampleMean):
        raise LossError(f"loss_reduction={reduction!r} is not a reduction stagewise knows; give "
                        "sw.TokenMean(ignore_index=-100) or sw.SampleMean() (or None: the mean of microbatch means)")
    if isinstance(reduction, TokenMean) and (isinstance(reduction.ignore_index, bool)
                                             or not isinstance(reduction.ignore_index, int)):
        raise LossError(f"TokenMean(ignore_index={reduction.ignore_index!r}) must be an int, e.g. -100")
    if isinstance(reduction, TokenMean) and not isinstance(reduction.shift, bool):
        raise LossError(f"TokenMean(shift={reduction.shift!r}) must be True or False")
    if has_loss_fn and reduction.labels is not None:
        raise LossError(f"loss_reduction names labels={reduction.labels!r} but loss_fn is given: the counts come "
                        "from the target; drop labels=")
    if not has_loss_fn and reduction.labels not in inputs:
        raise LossError(f"loss_reduction={reduction!r} needs labels= naming the model input that holds the labels "
                        f"(one of {inputs}) when the model returns its own loss, e.g. "
                        "sw.TokenMean(labels='labels', shift=True) for a causal LM")


def loss_weights(reduction: LossReduction, pieces: list[dict[str, torch.Tensor]],
                 target_name: str | None) -> tuple[float, ...]:
    """Each microbatch's share of the batch's counted items (0 for a microbatch that counts none)."""
    name = reduction.labels if reduction.labels is not None else target_name
    if name is None:  # compile refuses a reduction with neither (check above); a guard, not a path users reach
        raise LossError(f"loss_reduction={reduction!r} counts the labels' items, but no labels= and no target name them")
    counts = [reduction.count(piece[name]) for piece in pieces]
    total = sum(counts)
    return tuple(count / total if total else 0.0 for count in counts)


def model_reduction(model: torch.nn.Module, inputs: list[str], loss_fn: object = None) -> LossReduction | None:
    """The reduction of a Hugging Face model's own loss (no `loss_fn`) when it is given `labels` and
    its forward takes the loss keyword arguments (`num_items_in_batch`, transformers 4.46 on; the
    Trainer's test): the mean over the labels that are not -100, counted after the shift a causal
    LM's loss makes (not an encoder-decoder's, whose labels are its decoder's targets). None for any
    other model, and for a loss that is not such a mean (sequence classification, CTC, ...)."""
    if loss_fn is not None or "labels" not in inputs or not _takes_loss_kwargs(model):
        return None
    hf = sys.modules.get("transformers.loss.loss_utils")  # loaded with any Hugging Face model
    loss_function = getattr(model, "loss_function", None)  # what its forward calls (loss_type None: causal LM)
    if hf is None or loss_function not in (hf.ForCausalLMLoss, hf.ForMaskedLMLoss, hf.ForTokenClassification):
        return None
    encoder_decoder = bool(getattr(getattr(model, "config", None), "is_encoder_decoder", False))
    return TokenMean(IGNORE_INDEX, labels="labels", shift=loss_function is hf.ForCausalLMLoss and not encoder_decoder)


def _takes_loss_kwargs(model: torch.nn.Module) -> bool:
    """The Hugging Face Trainer's test for passing `num_items_in_batch`: the model's own
    `accepts_loss_kwargs`, else a forward taking **kwargs."""
    accepts = getattr(model, "accepts_loss_kwargs", None)
    if accepts is not None:
        return bool(accepts)
    parameters = inspect.signature(model.forward).parameters.values()
    return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)


def padding_without_reduction(inputs: dict[str, torch.Tensor], target_name: str | None) -> str | None:
    """Why a step without a reduction is not eager's on the whole batch, if it is not: the targets
    (`loss_fn`'s, else the model input `labels`) hold -100, which a mean leaves out, so microbatches
    count different numbers of items and their means cannot simply be averaged."""
    name = target_name if target_name is not None else "labels"
    labels = inputs.get(name)
    if not isinstance(labels, torch.Tensor) or labels.is_floating_point() or not bool((labels == IGNORE_INDEX).any()):
        return None
    fix = ("sw.TokenMean(ignore_index=-100)" if target_name is not None
           else "sw.TokenMean(labels='labels', shift=True) (shift=False unless the loss drops each row's first label)")
    return (f"step got {name!r} holding {IGNORE_INDEX} (entries a mean loss leaves out) but no loss_reduction says "
            "how the loss counts them, so each microbatch's mean weighs its share of the samples and the step's "
            "loss and gradients are not eager's on the whole batch; compile with loss_reduction=" + fix
            + " (or set pipe.loss_reduction), or sw.SampleMean() if the loss is a mean over samples")
