"""The small problems both gloo ranks and the parent build alike, from seed 0 in every process."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import stagewise as sw
from tests.harness.ranks import RANKS
from tests.models.gpt import TinyGPT, lm_loss
from tests.models.mlp import mlp
from tests.reference import ADAMW, SGD

STEPS = 3
# Modes: "off" and "on" (swap=), "all" (swap="all": state and stashed activations), "host"
# (optimizer_on_host=True). Every mode but "on" trains with gradient clipping (the global-norm
# all-reduce, every update deferred); "on" keeps the jit-update path, where packs without a tied
# weight update right after their last backward. "one-stage" (stages=1) leaves rank 1 without a
# stage: it steps, saves and loads with nothing to run. "async" allows schedule="2bw" (asynchronous=True;
# the MLP then clips).
MODES = {"off": {"swap": "off"}, "on": {"swap": "on"}, "all": {"swap": "all"},
         "host": {"swap": "off", "optimizer_on_host": True}, "one-stage": {"swap": "off", "stages": 1},
         "async": {"swap": "off", "asynchronous": True}}


def problem(name: str, mode: str = "off") -> tuple[torch.nn.Module, list, dict]:
    """(model, batches, options for compile and eager_train): "mlp", "tied-gpt" or "hf-gpt2"."""
    torch.manual_seed(0)
    if name == "mlp":
        batches = [((torch.randn(8, 8),), torch.randint(0, 5, (8,))) for _ in range(STEPS)]
        clip = {"clip_grad_norm": 0.5} if mode == "async" else {}  # 2bw's update after the norm's all-reduce
        return mlp(), batches, {"loss_fn": F.cross_entropy, "optimizer": SGD, "microbatches": 2, **clip}
    clip = {"clip_grad_norm": 0.5 if name == "tied-gpt" else 1.0} if mode != "on" else {}
    if name == "hf-gpt2":
        from tests.hf import gpt2, lm_batches  # here: importing transformers costs every spawned rank 2 s

        return gpt2(), lm_batches(STEPS), {"optimizer": ADAMW, "microbatches": 2, **clip}
    model = TinyGPT()
    batches = []
    for _ in range(STEPS):
        ids = torch.randint(0, 64, (8, 9))
        batches.append(((ids[:, :-1],), ids[:, 1:]))
    return model, batches, {"loss_fn": lm_loss, "optimizer": ADAMW, "microbatches": 4, **clip}


def compile_case(name: str, schedule: str, mode: str) -> tuple[sw.Pipeline, list]:
    """With analytic costs: measured ones differ between the ranks, which could partition differently
    (a PlanError by design); these tests are about the runtime, not the planner."""
    model, batches, options = problem(name, mode)
    inputs, target = batches[0]
    if target is not None:
        options["example_target"] = target
    return sw.compile(model, RANKS, inputs, schedule=schedule, cost="analytic", **MODES[mode], **options), batches
