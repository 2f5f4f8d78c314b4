"""Training on the GPU checked against eager training on the GPU (tests/test_cuda.py,
tests/test_activation_swap.py); used only where a CUDA device is present."""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch

import stagewise as sw
from tests.models.gpt import lm_loss
from tests.reference import ADAMW, ATOL, RTOL, eager_train, pipeline_train


def check_on_gpu(model: torch.nn.Module, batches: list, devices: list[str], *, loss_fn: Callable | None = lm_loss,
                 **compile_kwargs: object) -> sw.Pipeline:
    """Train on the GPU(s) and eagerly on the GPU over the same microbatches (the same kernels; fp32,
    no TF32); equal losses and parameters. Eager on the CPU differs by the GPU's rounding, which
    AdamW turns into visible parameter differences."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    reference = copy.deepcopy(model).cuda()
    inputs, target = batches[0]
    pipe = sw.compile(model, devices, inputs, loss_fn=loss_fn, example_target=target, optimizer=ADAMW,
                      **compile_kwargs)
    got = torch.stack([loss.cpu() for loss in pipeline_train(pipe, batches)])
    want = torch.stack([loss.cpu() for loss in eager_train(
        reference, _on_gpu(batches), loss_fn=loss_fn, optimizer=ADAMW,
        microbatches=compile_kwargs.get("microbatches", 1), clip_grad_norm=compile_kwargs.get("clip_grad_norm"))])
    torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)
    state = reference.state_dict()
    for name, tensor in pipe.state_dict().items():
        torch.testing.assert_close(tensor.cpu(), state[name].cpu(), rtol=RTOL, atol=ATOL)
    return pipe


def _on_gpu(batches: list) -> list:
    def moved(value):
        if isinstance(value, dict):
            return {k: moved(v) for k, v in value.items()}
        if isinstance(value, tuple | list):
            return type(value)(moved(v) for v in value)
        return value.cuda() if isinstance(value, torch.Tensor) else value
    return [moved(batch) for batch in batches]


def gpus(n: int) -> list[str]:
    """n logical devices over the GPUs present (several on one GPU when there are fewer)."""
    return [f"cuda:{i % torch.cuda.device_count()}" for i in range(n)]
