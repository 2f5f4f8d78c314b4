"""Mixed precision at run time: the autocast stage forwards run under, and fp16's loss scaler.

Forwards and recomputes run under `autocast_for(precision, device)` (ir/precision.py; backward
runs outside, as torch recommends: its ops take the dtypes their forwards saved). With fp16 each
Backward seeds its loss with the scale, and the lowering always emits the global grad-norm
all-reduce (passes/lower.py): its total, the same on every device and rank, is the overflow
check. A total that is not finite skips the update of every stage (gradients dropped, optimizer
state and step counts untouched) and backs the scale off; a finite one unscales the gradients
with the clip coefficient of the unscaled norm, as GradScaler.unscale_ then clip_grad_norm_ do.
The scale changes only when a step commits, so a step rolled back leaves it as it was.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING

import torch

from stagewise.ir.precision import LossScaling, autocast_for

if TYPE_CHECKING:
    from stagewise.runtime.worker import StageWorker

__all__ = ["LossScaler", "autocast_for", "enclosing_autocast", "grad_coefficient", "skip_update"]

AUTOCAST_DEVICE_TYPES = ("cpu", "cuda")


class LossScaler:
    """The dynamic loss scale of torch.amp.GradScaler (its growth tracker: `clean_steps`)."""

    def __init__(self, scaling: LossScaling):
        self.scaling = scaling
        self.scale = float(scaling.init)
        self.clean_steps = 0  # completed steps without overflow since the scale last changed

    def conclude(self, overflowed: bool) -> None:
        """After a committed step: back off on overflow, grow after `growth_interval` clean steps."""
        if overflowed:
            self.scale *= self.scaling.backoff
            self.clean_steps = 0
            return
        self.clean_steps += 1
        if self.clean_steps == self.scaling.growth_interval:
            self.scale *= self.scaling.growth
            self.clean_steps = 0

    def state_dict(self) -> dict:
        """What a checkpoint keeps (training.pt, plain values) so a resumed run scales as an uninterrupted one."""
        return {"scaling": dataclasses.asdict(self.scaling), "scale": self.scale, "clean_steps": self.clean_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scaling = LossScaling(**state["scaling"])
        self.scale, self.clean_steps = float(state["scale"]), int(state["clean_steps"])


def grad_coefficient(norm: float, clip_grad_norm: float | None, scale: float) -> float:
    """What the gradients are multiplied by before the update: 1 / scale (unscaling) times the clip
    coefficient of the unscaled `norm` (1 without clipping), clip_grad_norm_'s formula."""
    clip = math.inf if clip_grad_norm is None else clip_grad_norm
    return min(clip / (norm + 1e-6), 1.0) / scale


def skip_update(worker: StageWorker) -> None:
    """The step overflowed somewhere: drop this stage's gradients (on the device or sent to host
    memory) without stepping; weights and optimizer state stay as they were."""
    worker.norm_part, worker.clip_coefficient = None, None
    for name, param in worker.params.items():
        param.grad = None
        worker.host.pop(("grads", name), None)
    worker.pool.release(("grads", worker.stage.index))


def enclosing_autocast() -> str | None:
    """The device type of a torch.autocast the caller runs in (None if none): the stream threads
    that compute would not see it (autocast is per thread), so a step must not silently ignore it."""
    return next((kind for kind in AUTOCAST_DEVICE_TYPES if torch.is_autocast_enabled(kind)), None)
