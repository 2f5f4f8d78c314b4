"""PipeDream-2BW's update rule (Narayanan §3.2.1) in plain PyTorch, W(t+1) = W(t) - lr * grad f(W(t-1)),
and a pipeline's second weight version: what tests/test_two_bw.py (one process) and
tests/test_distributed.py (gloo ranks) check schedule="2bw" against."""

from __future__ import annotations

import copy

import torch

from tests.reference import chunks


def two_bw_reference(model, batches, optimizer, loss_fn, clip_grad_norm=None, *, microbatches: int):
    """The paper's rule in plain PyTorch: `used` (W(t-1)) computes step t's gradients, accumulated over
    the microbatches (and clipped); the optimizer steps `newest` (W(t)) with them; `used` then becomes W(t)."""
    used, newest = model, copy.deepcopy(model)
    opt = optimizer(newest.parameters())
    losses = []
    for inputs, target in batches:
        used.zero_grad(set_to_none=True)
        total = torch.zeros(())
        for mb_inputs, mb_target in chunks(inputs, target, microbatches):
            loss = loss_fn(used(*mb_inputs), mb_target) / microbatches
            loss.backward()
            total += loss.detach()
        if clip_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(used.parameters(), clip_grad_norm)
        for to_step, computed in zip(newest.parameters(), used.parameters(), strict=True):
            to_step.grad = computed.grad
        current = copy.deepcopy(newest.state_dict())  # W(t)
        opt.step()
        used.load_state_dict(current)
        losses.append(total)
    return losses, used, newest


def newest_state(pipe) -> dict[str, torch.Tensor]:
    """The pipeline's newest weight versions by the stages' names (the model's; a tie under each stage's):
    in a gloo rank, only that rank's stages'."""
    return {name: tensor for worker in pipe._workers for name, tensor in worker.weight_versions.newest.items()}
