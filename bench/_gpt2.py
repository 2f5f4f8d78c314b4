"""The Hugging Face GPT-2 the step-time benches train, its fixed split, eager steps and round-robin timing.

Not a benchmark itself: bench/precision.py and bench/gpu_step.py share these so that their eager
baselines, models and splits are the same code (imported as `_gpt2`, bench/ on sys.path).
"""

from __future__ import annotations

import functools
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from transformers import GPT2Config, GPT2LMHeadModel

ADAMW = functools.partial(torch.optim.AdamW, lr=3e-4)


@dataclass
class Config:
    """One way of training: a step function returning the step's loss."""

    name: str
    step: Callable[[], float]
    seconds: list[float] = field(default_factory=list)
    cpu_seconds: list[float] = field(default_factory=list)
    loss: float = float("nan")

    @property
    def median_ms(self) -> float:
        return statistics.median(self.seconds) * 1e3


def gpt2(layers: int, dim: int, heads: int, length: int, vocab: int = 1024) -> GPT2LMHeadModel:
    """examples/demo.py's model at its defaults, random weights; dropout off so every configuration
    computes the same function."""
    config = GPT2Config(n_layer=layers, n_embd=dim, n_head=heads, vocab_size=vocab,
                        n_positions=max(64, length), resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                        bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config)


def split_points(layers: int, devices: int) -> list[str]:
    """One stage per device: the blocks in `devices` - 1 equal runs, the last stage the final norm and the
    head (6 blocks on 4 devices: split after blocks 1, 3 and 5)."""
    return [f"transformer.h.{layers * (i + 1) // (devices - 1) - 1}" for i in range(devices - 1)]


def eager_step(model: GPT2LMHeadModel, ids: torch.Tensor, bf16: bool, microbatches: int = 1) -> Callable[[], float]:
    """A plain PyTorch training step on `ids`' device (AdamW, clip 1.0), bf16 by autocast around the
    forward; with `microbatches` > 1 gradients accumulate over equal chunks of the batch, each loss
    scaled by 1 / microbatches (every token is labelled, so that is the whole batch's token mean)."""
    model.to(ids.device)
    optimizer = ADAMW(model.parameters())
    chunks = ids.chunk(microbatches)

    def step() -> float:
        optimizer.zero_grad()
        total = torch.zeros((), device=ids.device)
        for chunk in chunks:
            with torch.autocast(ids.device.type, dtype=torch.bfloat16, enabled=bf16):
                loss = model(input_ids=chunk, labels=chunk).loss / len(chunks)
            loss.backward()
            total += loss.detach()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        return total.item()

    return step
