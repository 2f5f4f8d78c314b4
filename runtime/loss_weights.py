"""Each microbatch's weight in the step's loss: 1 / microbatches (the mean of microbatch means)
unless the pipeline knows the share of the batch's counted items each one holds (a declared
loss reduction, compiler/assembly/loss_reduction.py), so the step equals eager training on the whole batch."""

from __future__ import annotations

from typing import cast

import torch


class LossWeights:
    """The weights of the step about to run, set by the feed; shared by a pipeline's executors."""

    def __init__(self) -> None:
        self.weights: tuple[float, ...] | None = None  # None: every microbatch weighs 1 / microbatches

    def seed(self, microbatch: int, microbatches: int) -> float:
        """The gradient the microbatch's Backward seeds its loss with (0: its backward skips the loss)."""
        return 1.0 / microbatches if self.weights is None else self.weights[microbatch]

    def total(self, losses: dict[int, torch.Tensor], microbatches: int) -> torch.Tensor | None:
        """These microbatches' part of the step's loss, times `microbatches` (the executor divides):
        a microbatch of weight 0 adds nothing, even where its own mean is 0 / 0."""
        if not losses:
            return None
        if self.weights is None:
            return cast(torch.Tensor, sum(losses[mb] for mb in sorted(losses)))  # not empty: a tensor
        weights = self.weights
        terms = [losses[mb] * (weights[mb] * microbatches) for mb in sorted(losses) if weights[mb]]
        return cast(torch.Tensor, sum(terms)) if terms else torch.zeros_like(next(iter(losses.values())))
