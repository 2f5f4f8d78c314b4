"""The precisions a pipeline trains in, and the autocast context each stands for.

"fp32" runs every op in its inputs' dtype (no autocast). "bf16" and "fp16" run stage forwards
(and recomputes) under `torch.autocast` of that dtype: torch decides per op which run in the low
precision (matmuls, convolutions, linear) and which stay fp32 (softmax, norms, losses). The
parameters stay fp32 (the masters: autocast casts them on the fly), and so do gradients,
optimizer state and every reduction. fp16's narrow range needs loss scaling (`LossScaling`).
At the bottom of the layers: the profiler (passes) and the runtime both run under it.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch

from stagewise.ir.errors import PrecisionError

AUTOCAST_DTYPES: dict[str, torch.dtype | None] = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
PRECISIONS = tuple(AUTOCAST_DTYPES)


@dataclass(frozen=True)
class LossScaling:
    """fp16's dynamic loss scaling, as torch.amp.GradScaler's: the backward seeds the loss with
    `init` times its weight; a step whose gradients hold an inf or NaN (on any stage) is skipped
    everywhere and the scale multiplied by `backoff`; after `growth_interval` clean steps in a row
    it is multiplied by `growth`. Pass it as compile's `precision=` to train in fp16 with these
    settings (`precision="fp16"` takes the defaults).

    Args:
        init: the first scale, finite and above 0.
        growth: the factor after `growth_interval` clean steps, above 1.
        backoff: the factor after a step with an inf or NaN gradient, between 0 and 1.
        growth_interval: clean steps in a row before the scale grows, a positive int.

    Raises:
        PrecisionError: a value out of those ranges, or of the wrong type.

    Example:
        >>> sw.LossScaling(init=1024.0)
        LossScaling(init=1024.0, growth=2.0, backoff=0.5, growth_interval=2000)
        >>> sw.LossScaling(backoff=2)
        Traceback (most recent call last):
        ...
        stagewise.ir.errors.PrecisionError: LossScaling(backoff=2): give a number between 0 and 1, e.g. 0.5
    """

    init: float = 2.0**16
    growth: float = 2.0
    backoff: float = 0.5
    growth_interval: int = 2000

    def __post_init__(self) -> None:
        fields = {"init": (self.init, 0.0), "growth": (self.growth, 1.0)}
        for name, (value, above) in fields.items():
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= above:
                raise PrecisionError(f"LossScaling({name}={value!r}): give a finite number above {above}, "
                                     "e.g. LossScaling(init=2.0**16, growth=2.0)")
        if isinstance(self.backoff, bool) or not isinstance(self.backoff, int | float) or not 0 < self.backoff < 1:
            raise PrecisionError(f"LossScaling(backoff={self.backoff!r}): give a number between 0 and 1, e.g. 0.5")
        interval = self.growth_interval
        if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
            raise PrecisionError(f"LossScaling(growth_interval={interval!r}): give a positive int, e.g. 2000")


def check_precision(precision: object) -> str:
    """The precision's name ("fp16" for a LossScaling); an unknown one is refused."""
    if isinstance(precision, LossScaling):
        return "fp16"
    if not isinstance(precision, str) or precision not in AUTOCAST_DTYPES:
        raise PrecisionError(f"unknown precision={precision!r}; choose one of {', '.join(map(repr, PRECISIONS))}, "
                             "or sw.LossScaling(...) for fp16 with your own loss-scaling settings")
    return precision


def autocast_for(precision: str, device: torch.device) -> contextlib.AbstractContextManager:
    """The context stage forwards on `device` run under: torch.autocast of the precision's dtype
    for the device's type (no autocast for fp32)."""
    dtype = AUTOCAST_DTYPES[precision]
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)
