"""Eager training as torch's AMP recipe writes it, the reference for mixed precision on the CPU
(tests/test_precision.py) and the GPU (tests/test_cuda.py), and the tolerances it is held to
(their reasons: tests/test_precision.py's docstring)."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from tests.reference import chunks, model_loss

SGD = functools.partial(torch.optim.SGD, lr=0.05, momentum=0.9)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
LOSS_RTOL, PARAM_ATOL = 2e-3, 5e-4


def eager_autocast_train(model: torch.nn.Module, batches: list, precision: str, microbatches: int,
                         loss_fn: Callable | None = None, clip: float | None = None, norms: list | None = None,
                         device: str = "cpu") -> list[float]:
    """Eager training as torch's AMP recipe writes it: forward and loss under autocast, backward outside
    (the model and batches on `device`)."""
    opt = SGD(model.parameters())
    scaler = torch.amp.GradScaler(device) if precision == "fp16" else None
    batches = [(torch.utils._pytree.tree_map(lambda t: t.to(device), inputs),
                None if target is None else target.to(device)) for inputs, target in batches]
    losses = []
    for inputs, target in batches:
        opt.zero_grad()
        total = 0.0
        for mb_inputs, mb_target in chunks(inputs, target, microbatches):
            with torch.autocast(device, dtype=DTYPES[precision]):
                loss = model_loss(model, mb_inputs, mb_target, loss_fn) / microbatches
            (scaler.scale(loss) if scaler else loss).backward()
            total += loss.detach()
        if scaler:
            scaler.unscale_(opt)
        if clip is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        if scaler:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        losses.append(float(total))
    return losses
