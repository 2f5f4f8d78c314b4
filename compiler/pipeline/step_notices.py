"""What a pipeline tells its user about its steps, once per pipeline however often the cause repeats:
targets padded with -100 that no loss reduction counts (compiler/assembly/loss_reduction.py), and updates
skipped because the gradients held an inf or NaN, which `pipe.skipped_steps` counts. Eager training
would not skip an fp32 or bf16 update: clip_grad_norm_ would write NaN into every weight."""

from __future__ import annotations

import warnings

import torch

from stagewise.compiler.assembly.loss_reduction import padding_without_reduction
from stagewise.ir.errors import SkippedUpdateWarning, UnweightedLossWarning
from stagewise.runtime.executor import StreamExecutor


class StepNotices:
    """The warnings already given by one pipeline, and its count of skipped updates."""

    def __init__(self) -> None:
        self.skipped_steps = 0
        self._given: set[type[Warning]] = set()

    def warn_once(self, category: type[Warning], message: str) -> None:
        """`message` unless this pipeline already gave a warning of `category`."""
        if category not in self._given:
            self._given.add(category)
            warnings.warn(message, category, stacklevel=3)

    def padding_uncounted(self, inputs: dict[str, torch.Tensor], target_name: str | None) -> None:
        """Before a step without a loss reduction: warn if its targets hold padding (looked for only
        until this pipeline has warned: it reads the targets, on a GPU a wait for them)."""
        if UnweightedLossWarning not in self._given:
            why = padding_without_reduction(inputs, target_name)
            if why is not None:
                self.warn_once(UnweightedLossWarning, why)

    def step_done(self, executor: StreamExecutor) -> None:
        """After `executor` committed a step: count it if its update was skipped, and say so the first time."""
        if not executor.state.last_step_skipped:
            return
        self.skipped_steps += 1
        eager = ("as torch.amp.GradScaler skips it, and the loss scale backed off" if executor.state.scaler is not None else
                 "where eager training with clip_grad_norm_ would have written NaN into every weight "
                 "(clip_grad_norm_(..., error_if_nonfinite=True) raises instead)")
        self.warn_once(SkippedUpdateWarning, f"step {executor.state.iteration}: the gradients hold an inf or NaN, so no stage updated "
                       f"(weights and optimizer state as before), {eager}; pipe.skipped_steps counts such steps "
                       "(this warning is given once per pipeline). Look for a loss or input that is not finite")
