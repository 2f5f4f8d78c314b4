"""Eager single-device training, the reference every pipeline must equal."""

from __future__ import annotations

import copy
import functools

import torch

import stagewise as sw
from tests.models.gpt import lm_loss

SGD = functools.partial(torch.optim.SGD, lr=0.05, momentum=0.9)
# AdamW divides each gradient element by its own running magnitude, so float32 rounding in an
# element whose gradient is near zero (measured: 2e-9 absolute on gradients up to 3e-2 between
# the exported graph and eager Hugging Face code) becomes an update difference of lr * 2e-9 / eps.
# eps=1e-4 keeps that below the tolerance; a real gradient error still moves parameters by ~lr.
# SGD tests compare with no such allowance.
ADAMW = functools.partial(torch.optim.AdamW, lr=1e-2, weight_decay=0.1, eps=1e-4)
RTOL, ATOL = 1e-5, 1e-6


def model_loss(model, inputs, target, loss_fn):
    out = model(**inputs) if isinstance(inputs, dict) else model(*inputs)
    if loss_fn is not None:
        return loss_fn(out, target)
    return out if isinstance(out, torch.Tensor) else out.loss


def chunks(inputs, target, microbatches: int):
    if isinstance(inputs, dict):
        parts = [{k: v.chunk(microbatches)[i] for k, v in inputs.items()} for i in range(microbatches)]
    else:
        parts = [tuple(v.chunk(microbatches)[i] for v in inputs) for i in range(microbatches)]
    targets = target.chunk(microbatches) if target is not None else [None] * microbatches
    return list(zip(parts, targets, strict=True))


def eager_train(model, batches, *, loss_fn=None, optimizer=SGD, microbatches=1, clip_grad_norm=None,
                after_step=None, norms=None):
    """Losses per step of eager training with gradient accumulation over `microbatches` slices;
    `after_step()` runs after each update (an LR scheduler's step), and `norms` collects the
    gradient norms clipping measured."""
    opt = optimizer(model.parameters())
    losses = []
    for inputs, target in batches:
        opt.zero_grad()
        total = 0.0
        for mb_inputs, mb_target in chunks(inputs, target, microbatches):
            loss = model_loss(model, mb_inputs, mb_target, loss_fn) / microbatches
            loss.backward()
            total += loss.detach()
        if clip_grad_norm is not None:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip_grad_norm)
            if norms is not None:
                norms.append(float(norm))
        opt.step()
        if after_step is not None:
            after_step()
        losses.append(total)
    return losses


def pipeline_train(pipe, batches):
    losses = []
    for inputs, target in batches:
        kwargs = {"target": target} if pipe.plan.target_name else {}
        losses.append(pipe.step(**inputs, **kwargs) if isinstance(inputs, dict) else pipe.step(*inputs, **kwargs))
    return losses


def check_equal_training(
    model, batches, devices, *, loss_fn=None, optimizer=SGD, microbatches=1, clip_grad_norm=None, cost="analytic",
    **compile_kwargs
):
    """Train a pipeline and an eager copy side by side; assert equal losses and parameters.

    Planned with analytic costs unless `cost` says otherwise: equality with eager holds whatever the
    costs, the plans do not hang on this machine's timings, and profiling (the graph run on fake
    tensors at three microbatch sizes, then timed) added 0.1-0.5 CPU-s to a 1.5 s compile. The profiler
    stays tested by tests/test_costs.py and test_inplace.py, and by every compile left at the default."""
    reference = copy.deepcopy(model)
    inputs, target = batches[0]
    pipe = sw.compile(
        model, devices, inputs, loss_fn=loss_fn, example_target=target, optimizer=optimizer,
        microbatches=microbatches, clip_grad_norm=clip_grad_norm, cost=cost, **compile_kwargs,
    )
    got = pipeline_train(pipe, batches)
    want = eager_train(reference, batches, loss_fn=loss_fn, optimizer=optimizer, microbatches=microbatches,
                       clip_grad_norm=clip_grad_norm)
    torch.testing.assert_close(torch.stack(got), torch.stack(want), rtol=RTOL, atol=ATOL)
    assert_state_equal(pipe.state_dict(), reference.state_dict())
    return pipe


def assert_state_equal(got: dict, want: dict) -> None:
    assert set(got) == set(want), f"state keys differ: {set(got) ^ set(want)}"
    for name, tensor in want.items():
        torch.testing.assert_close(got[name], tensor, rtol=RTOL, atol=ATOL, msg=lambda m, n=name: f"{n}: {m}")


def token_batches(steps=3, batch=8, length=8, vocab=64):
    """Next-token batches: inputs and targets shifted by one (for TinyGPT and lm_loss)."""
    out = []
    for _ in range(steps):
        ids = torch.randint(0, vocab, (batch, length + 1))
        out.append(((ids[:, :-1],), ids[:, 1:]))
    return out


def first_device_peak(model, devices: int, schedule: str) -> int:
    """Device 0's peak pool bytes in one TinyGPT-style step, optimizer state left out."""
    ids = torch.randint(0, 64, (8, 8))
    pipe = sw.compile(model, devices, (ids,), loss_fn=lm_loss, example_target=ids, microbatches=8,
                      schedule=schedule)
    pipe.step(ids, target=ids)
    return pipe.stats[0]["peak_bytes"] - pipe.stats[0]["optimizer_bytes"]
