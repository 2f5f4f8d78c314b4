"""Batches whose shape varies from step to step, and the eager training they are checked against."""

from __future__ import annotations

from collections.abc import Callable

import torch

import stagewise as sw
from tests.reference import SGD, model_loss

LENGTHS = (12, 7, 10, 12)  # per step; the example is the longest
BATCHES = (8, 8, 7, 5)  # the last two do not divide into 2 or 4 microbatches


def varied_lm_batches(vocab: int = 128, seed: int = 0) -> list:
    """Hugging Face causal-LM batches (input_ids and labels) of LENGTHS and BATCHES."""
    generator = torch.Generator().manual_seed(seed)
    batches = []
    for batch, length in zip(BATCHES, LENGTHS, strict=True):
        ids = torch.randint(1, vocab, (batch, length), generator=generator)
        batches.append(({"input_ids": ids, "labels": ids.clone()}, None))
    return batches


def varied_gpt_batches(seed: int = 0) -> list:
    """(tokens,), next tokens for the tied GPT, of LENGTHS and BATCHES."""
    generator = torch.Generator().manual_seed(seed)
    batches = []
    for batch, length in zip(BATCHES, LENGTHS, strict=True):
        ids = torch.randint(0, 64, (batch, length + 1), generator=generator)
        batches.append(((ids[:, :-1],), ids[:, 1:]))
    return batches


def eager_split_train(model: torch.nn.Module, batches: list, *, microbatches: int, loss_fn: Callable | None = None,
                      optimizer: Callable = SGD) -> list[torch.Tensor]:
    """Eager training on the pipeline's split (torch.tensor_split), each microbatch weighing its share
    of the samples: equal to eager training on the whole batch, up to rounding, for models whose
    samples do not interact (no BatchNorm): for those it is what the pipeline computes exactly."""
    opt = optimizer(model.parameters())
    losses = []
    for inputs, target in batches:
        opt.zero_grad()
        batch = (target if target is not None else next(iter(inputs.values()))).shape[0]
        total = torch.zeros(())
        for index in range(microbatches):
            def part(v, i=index):
                return v.tensor_split(microbatches)[i]
            mb_inputs = {k: part(v) for k, v in inputs.items()} if isinstance(inputs, dict) else tuple(map(part, inputs))
            mb_target = part(target) if target is not None else None
            share = next(iter(mb_inputs.values()) if isinstance(mb_inputs, dict) else iter(mb_inputs)).shape[0] / batch
            loss = model_loss(model, mb_inputs, mb_target, loss_fn) * share
            loss.backward()
            total += loss.detach()
        opt.step()
        losses.append(total)
    return losses


def train_steps(pipe: sw.Pipeline, batches: list) -> list[torch.Tensor]:
    """One pipe.step per batch, inputs given as the batch holds them (keywords or positions)."""
    losses = []
    for inputs, target in batches:
        kwargs = {"target": target} if target is not None else {}
        losses.append(pipe.step(**inputs, **kwargs) if isinstance(inputs, dict) else pipe.step(*inputs, **kwargs))
    return losses
