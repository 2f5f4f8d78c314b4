"""Property (issue 21, item 3): every trainable parameter gets eager autocast's gradient, whatever
the precision, the schedule, what is frozen and on how many devices; a frozen one never moves.

One SGD step with lr=1 and nothing else moves each parameter by minus its gradient (the masters
are fp32; fp16's loss scale is a power of two, so unscaling is exact), so the pipeline's update is
compared with the gradient eager torch.autocast training computes over the same microbatches.

The sweep is precision (3) x schedule (6) x frozen pattern (5) x device count (3): the cases below
cover every pair of precision and schedule, precision and pattern, pattern and device count, and
schedule and device count, among them the defect's reproduction (peft LoRA, bf16, 2 devices:
before passes/precision_casts.py gave its casts a value, no stage but the last got a gradient).

Tolerance: the pipeline runs eager's ops in eager's dtypes; what differs is the order of fp32 sums
(a gradient summed across microbatches, stages or a tied weight's holders) and, for the Hugging
Face Llama, the exported graph's ops beside eager's code: under bf16 / fp16 an activation rounded
once differently changes a gradient by an ulp or two of the low precision, relative to the
tensor's largest element. Each tensor's update must equal its gradient within TOLERANCE times that
element, plus an fp32 ulp of the weight (the update is the difference of two weights).
Measured worst: fp32 1e-7, bf16 6.4e-3 (about 2**-7), fp16 8.4e-4 (about 2**-10); the TinyGPT
cases equal but for that ulp in every precision. A missing or wrong gradient is off by its own size.
"""

from __future__ import annotations

import copy
import functools
import itertools
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
import torch.nn as nn

import stagewise as sw
from stagewise.ir.precision import AUTOCAST_DTYPES
from stagewise.passes.schedule import SCHEDULES
from tests.hf import llama, lm_batches
from tests.models.gpt import TinyGPT, lm_loss
from tests.reference import chunks, model_loss, token_batches

SGD_BY_THE_GRADIENT = functools.partial(torch.optim.SGD, lr=1.0)
TOLERANCE = {"fp32": 1e-5, "bf16": 2e-2, "fp16": 3e-3}
BATCH = 6

# cut-points per stage count: every layer of the 2-block models their own stage at 6
GPT_LAYERS = ["tok", "pos", "blocks.0", "blocks.1", "ln_f", "head"]
GPT_SPLITS = {1: [], 2: ["blocks.1"], 3: ["blocks.0", "blocks.1"], 4: ["blocks.0", "blocks.1", "ln_f"],
              6: GPT_LAYERS[1:]}
LLAMA_LAYERS = ["model.embed_tokens", "model.rotary_emb", "model.layers.0", "model.layers.1", "model.norm", "lm_head"]
LLAMA_SPLITS = {1: [], 2: ["model.layers.1"], 3: ["model.layers.0", "model.layers.1"],
                4: ["model.layers.0", "model.layers.1", "model.norm"], 6: LLAMA_LAYERS[1:]}


@dataclass(frozen=True)
class Pattern:
    """A model with some of it frozen, built for a pipeline of `stages` stages, and where to cut it."""

    build: Callable[[int], nn.Module]
    splits: dict[int, list[str]]
    hugging_face: bool  # keyword batches and the model's own loss, else token batches and lm_loss


def lora_llama(stages: int) -> nn.Module:
    """peft LoRA on q_proj / v_proj: the whole base frozen, only the adapters train."""
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    tuned = peft.get_peft_model(llama(2), config)
    for name, param in tuned.named_parameters():
        if "lora_B" in name:  # peft starts B at zero, which leaves A without a gradient
            nn.init.normal_(param, std=0.02)
    return tuned


def frozen_bottom_llama(stages: int) -> nn.Module:
    """Embeddings and the first decoder layer frozen: the stages that hold them train nothing."""
    model = llama(2)
    for module in (model.model.embed_tokens, model.model.layers[0]):
        module.requires_grad_(False)
    return model


def frozen_embeddings_gpt(stages: int) -> nn.Module:
    model = TinyGPT(layers=2, tie=False)
    model.tok.requires_grad_(False)
    model.pos.requires_grad_(False)
    return model


def frozen_tied_gpt(stages: int) -> nn.Module:
    """The embedding, tied to the LM head on another stage, frozen: neither holder moves it."""
    model = TinyGPT(layers=2)
    model.tok.weight.requires_grad_(False)
    return model


def idle_stage_gpt(stages: int) -> nn.Module:
    """Every layer of the middle stage frozen (on 2 stages the last, which holds the loss): it has
    nothing to train, yet must send the stages before it their gradients. On 1 stage: its first block."""
    model = TinyGPT(layers=2, tie=False)
    bounds = [0, *(GPT_LAYERS.index(s) for s in GPT_SPLITS[stages]), len(GPT_LAYERS)]
    middle = stages // 2
    frozen = GPT_LAYERS[bounds[middle]:bounds[middle + 1]] if stages > 1 else ["blocks.0"]
    for name in frozen:
        model.get_submodule(name).requires_grad_(False)
    return model


PATTERNS = {
    "lora": Pattern(lora_llama, {k: [f"base_model.model.{s}" for s in v] for k, v in LLAMA_SPLITS.items()}, True),
    "frozen-bottom": Pattern(frozen_bottom_llama, LLAMA_SPLITS, True),
    "frozen-embeddings": Pattern(frozen_embeddings_gpt, GPT_SPLITS, False),
    "frozen-tied": Pattern(frozen_tied_gpt, GPT_SPLITS, False),
    "idle-stage": Pattern(idle_stage_gpt, GPT_SPLITS, False),
}

CASES = [  # precision, schedule, frozen pattern, devices (a covering of the pairs named above)
    ("fp32", "gpipe", "frozen-embeddings", 3),
    ("fp32", "1f1b", "frozen-bottom", 3),
    ("fp32", "interleaved", "frozen-tied", 1),
    ("fp32", "varuna", "idle-stage", 2),
    ("fp32", "harmony-pp", "lora", 1),
    ("fp32", "harmony-dp", "idle-stage", 2),
    ("bf16", "gpipe", "frozen-embeddings", 1),
    ("bf16", "1f1b", "lora", 2),
    ("bf16", "interleaved", "frozen-bottom", 2),
    ("bf16", "varuna", "idle-stage", 1),
    ("bf16", "harmony-pp", "frozen-tied", 3),
    ("bf16", "harmony-dp", "frozen-tied", 3),
    ("fp16", "gpipe", "frozen-embeddings", 2),
    ("fp16", "1f1b", "frozen-bottom", 1),
    ("fp16", "interleaved", "idle-stage", 3),
    ("fp16", "varuna", "lora", 3),
    ("fp16", "harmony-pp", "frozen-tied", 2),
    ("fp16", "harmony-dp", "lora", 1),
    ("fp32", "zb-h1", "lora", 2),
    ("bf16", "zb-h1", "frozen-tied", 3),
    ("fp16", "zb-h1", "frozen-bottom", 1),
    ("fp32", "zb-v", "frozen-tied", 2),
    ("bf16", "zb-v", "idle-stage", 3),
    ("fp16", "zb-v", "lora", 1),
]


def stage_count(schedule: str, devices: int) -> int:
    """Interleaved, ZB-V and Harmony-PP run two stages per device, Harmony-DP two packs on every device."""
    return {"interleaved": 2 * devices, "zb-v": 2 * devices, "harmony-pp": 2 * devices,
            "harmony-dp": 2}.get(schedule, devices)


def eager_gradients(model: nn.Module, batch, precision: str, microbatches: int) -> dict[str, torch.Tensor | None]:
    """Each parameter's gradient as torch's AMP recipe computes it: forward and loss under autocast,
    backward outside, fp16's loss scaled by the pipeline's initial scale and the gradients unscaled."""
    (inputs, target), dtype = batch, AUTOCAST_DTYPES[precision]
    scale = sw.LossScaling().init if precision == "fp16" else 1.0
    for mb_inputs, mb_target in chunks(inputs, target, microbatches):
        with torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
            loss = model_loss(model, mb_inputs, mb_target, None if target is None else lm_loss) / microbatches
        (loss * scale).backward()
    return {name: None if p.grad is None else p.grad / scale for name, p in model.named_parameters()}


def one_step_update(pattern: Pattern, model: nn.Module, batch, precision: str, schedule: str, devices: int,
                    microbatches: int) -> dict[str, torch.Tensor]:
    """Each parameter (tied ones under every name) minus what one pipeline SGD step left of it."""
    before = {name: p.detach().clone() for name, p in model.named_parameters(remove_duplicate=False)}
    inputs, target = batch
    pipe = sw.compile(model, devices, inputs, loss_fn=None if pattern.hugging_face else lm_loss,
                      example_target=target, optimizer=SGD_BY_THE_GRADIENT, microbatches=microbatches,
                      schedule=schedule, split_points=pattern.splits[stage_count(schedule, devices)] or None,
                      cost="analytic", precision=precision)
    if pattern.hugging_face:
        pipe.step(**inputs)
    else:
        pipe.step(*inputs, target=target)
    assert not pipe.last_step_skipped
    after = pipe.state_dict()
    return {name: value - after[name] for name, value in before.items()}


@pytest.mark.parametrize(("precision", "schedule", "pattern", "devices"), CASES)
def test_every_trainable_parameter_gets_eager_gradient(precision: str, schedule: str, pattern: str,
                                                       devices: int) -> None:
    """Trainable: updated by eager's gradient (moved wherever that is nonzero); frozen: bitwise unmoved."""
    torch.manual_seed(0)
    chosen, microbatches = PATTERNS[pattern], 3 if devices == 3 else 2
    model = chosen.build(stage_count(schedule, devices))
    batch = lm_batches(steps=1, batch=BATCH)[0] if chosen.hugging_face else token_batches(steps=1, batch=BATCH)[0]
    want = eager_gradients(copy.deepcopy(model), batch, precision, microbatches)
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    frozen = {name for name, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}
    assert trainable and frozen
    weights = {name: float(p.detach().abs().max()) for name, p in model.named_parameters()}
    update = one_step_update(chosen, model, batch, precision, schedule, devices, microbatches)
    moved_frozen = sorted(name for name in frozen if update[name].count_nonzero())
    assert not moved_frozen, f"frozen parameters moved: {moved_frozen}"
    stuck = sorted(name for name in trainable
                   if want[name] is not None and want[name].count_nonzero() and not update[name].count_nonzero())
    assert not stuck, f"trainable parameters with a nonzero eager gradient did not move: {stuck}"
    for name in sorted(trainable):
        expected = torch.zeros_like(update[name]) if want[name] is None else want[name]
        # the update is the fp32 difference of the weight before and after it: an ulp of the weight
        atol = TOLERANCE[precision] * float(expected.abs().max()) + torch.finfo(torch.float32).eps * weights[name]
        torch.testing.assert_close(update[name], expected, rtol=0, atol=atol, msg=lambda m, n=name: f"{n}: {m}")


def test_the_cases_cover_every_pair_the_sweep_names() -> None:
    """The 24 cases hold every pair of precision and schedule, precision and pattern, pattern and
    device count, schedule and device count (a covering array: the full product is 270 compiles)."""
    # every synchronous schedule compile accepts ("auto" picks one); 2bw's one-step-stale update is held
    # to its own rule, frozen parameters included, by tests/test_two_bw.py
    schedules = tuple(s for s in SCHEDULES if s != "auto" and not sw.Schedule(s).asynchronous)
    axes = {"precision": tuple(AUTOCAST_DTYPES), "schedule": schedules, "pattern": tuple(PATTERNS), "devices": (1, 2, 3)}
    columns = dict(zip(axes, zip(*CASES, strict=True), strict=True))
    for a, b in [("precision", "schedule"), ("precision", "pattern"), ("pattern", "devices"), ("schedule", "devices")]:
        missing = set(itertools.product(axes[a], axes[b])) - set(zip(columns[a], columns[b], strict=True))
        assert not missing, f"no case for ({a}, {b}) in {sorted(missing)}"
