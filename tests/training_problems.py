"""The training-loop problems the distributed and single-process training API tests share: the
tied GPT (with dropout), Hugging Face GPT-2 and Llama from configs with dropout, batches (padded
labels on demand), no-decay groups by name, a warmup-cosine schedule, and stepping helpers. Every
builder starts from a fixed seed, so every process builds the same problem."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

import stagewise as sw
from tests.models.cnn import ResNet
from tests.models.dropout import DropoutGPT
from tests.models.gpt import TinyGPT, lm_loss
from tests.reference import ADAMW

TIMEOUT_S = 20.0
MICROBATCHES = 4
LR = 1e-2


def hf_gpt2(dropout: float) -> GPT2LMHeadModel:
    """Tied embedding and head (the Hugging Face default), torch.export's graph."""
    config = GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=128, n_positions=32, resid_pdrop=dropout,
                        embd_pdrop=dropout, attn_pdrop=dropout, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config)


def hf_llama(dropout: float) -> LlamaForCausalLM:
    config = LlamaConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=128, max_position_embeddings=32, attention_dropout=dropout,
                         tie_word_embeddings=False, pad_token_id=0, bos_token_id=0, eos_token_id=0)
    return LlamaForCausalLM(config)


def model_of(name: str, dropout: float) -> torch.nn.Module:
    """From seed 0, the same weights in every process."""
    torch.manual_seed(0)
    if name == "tied-gpt":
        return DropoutGPT(p=dropout, layers=2) if dropout else TinyGPT(layers=2)
    if name == "resnet":
        return ResNet(blocks=2)
    return hf_gpt2(dropout) if name == "hf-gpt2" else hf_llama(dropout)


def batches_of(name: str, steps: int, padded: bool = False) -> list:
    """(inputs, target) per step: tokens for the GPTs (keyword input_ids and labels for Hugging Face,
    the labels -100 past a random length per row when `padded`), images for the ResNet."""
    generator = torch.Generator().manual_seed(1)
    out = []
    for _ in range(steps):
        if name == "resnet":
            out.append(((torch.randn(8, 3, 8, 8, generator=generator),), torch.randint(0, 10, (8,), generator=generator)))
        elif name == "tied-gpt":
            ids = torch.randint(0, 64, (8, 9), generator=generator)
            out.append(((ids[:, :-1],), ids[:, 1:]))
        else:
            ids = torch.randint(1, 128, (8, 10), generator=generator)
            labels = ids.clone()
            if padded:
                for row, kept in enumerate(torch.randint(2, 11, (8,), generator=generator).tolist()):
                    labels[row, kept:] = -100
            out.append(({"input_ids": ids, "labels": labels}, None))
    return out


def no_decay_groups(named: list) -> list[dict]:
    """Hugging Face Trainer's grouping: no weight decay on biases and norms, by name."""
    no_decay = [n for n, _ in named if n.endswith(".bias") or "norm" in n or ".ln" in n or n.startswith("ln_f")]
    return [{"params": [n for n, _ in named if n not in no_decay], "weight_decay": 0.1},
            {"params": no_decay, "weight_decay": 0.0}]


def warmup_cosine(step: int) -> float:
    """Linear warmup over 2 steps, then a cosine decay over 4."""
    return (step + 1) / 2 if step < 2 else 0.5 * (1 + math.cos(math.pi * min(step - 2, 4) / 4))


GROUPED = sw.ParamGroups(torch.optim.AdamW, no_decay_groups, lr=LR, eps=1e-4)
LOSS_FNS = {"tied-gpt": lm_loss, "resnet": F.cross_entropy}


def compiled(name: str, batches: list, schedule: str, optimizer=ADAMW, devices: int = 2, **options) -> sw.Pipeline:
    inputs, target = batches[0]
    if name in LOSS_FNS:
        options.update(loss_fn=LOSS_FNS[name], example_target=target)
    pipe = sw.compile(model_of(name, options.pop("dropout", 0.0)), devices, inputs, schedule=schedule,
                      cost="analytic", optimizer=optimizer, microbatches=MICROBATCHES, **options)
    pipe.timeout_s = TIMEOUT_S
    return pipe


def step(pipe, batch) -> torch.Tensor:
    inputs, target = batch
    kwargs = {"target": target} if target is not None else {}
    return pipe.step(**inputs, **kwargs) if isinstance(inputs, dict) else pipe.step(*inputs, **kwargs)


def evaluate(pipe, batch) -> torch.Tensor:
    inputs, target = batch
    kwargs = {"target": target} if target is not None else {}
    return pipe.evaluate(**inputs, **kwargs) if isinstance(inputs, dict) else pipe.evaluate(*inputs, **kwargs)


def state_of(pipe) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in pipe.state_dict().items()}  # gathered from every rank


def train_scheduled(pipe, sched, batches) -> list[tuple[torch.Tensor, float | None, list[float]]]:
    """Per step: the loss, the gradient norm and the learning rates the step used."""
    out = []
    for batch in batches:
        lrs = [g["lr"] for g in pipe.optimizer.param_groups]
        out.append((step(pipe, batch), pipe.last_grad_norm, lrs))
        sched.step()
    return out
