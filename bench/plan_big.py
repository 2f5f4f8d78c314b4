"""How long and how much memory `sw.plan` takes for big models on hardware this machine lacks.

    python bench/plan_big.py                  # GPT-2 medium, a 7B Llama-shaped config, a 1000-layer chain
    python bench/plan_big.py --models gpt2-medium --devices 8

Each model is built on the meta device (no weights) and planned for 8 H100-like devices (80 GiB,
989 TFLOP/s bf16 dense, 3.35 TB/s) joined by NVLink (450 GB/s), bf16, AdamW. Printed beside each
prediction: a roofline estimate, 6 x parameters x tokens FLOPs over (devices x peak), divided by
the pipeline's bubble efficiency m / (m + p - 1) (m microbatches, p stages), so a reader can see
whether the prediction is plausible (it is higher: memory-bound ops, the optimizer step, sends
and the tied weights' all-reduce are charged too). Peak memory is this process's maximum resident
set after each plan (it only grows: read each row as "at most"). Nothing here is asserted.
"""

from __future__ import annotations

import argparse
import functools
import resource
import time
from dataclasses import dataclass

import _common
import torch
import torch.nn as nn
import torch.nn.functional as F
from rich.table import Table
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM
from transformers.utils import logging as hf_logging

import stagewise as sw

PEAK_BF16, MEMORY, BANDWIDTH, NVLINK = 989e12, "80GiB", "3.35TB/s", "450GB/s"
ADAMW = functools.partial(torch.optim.AdamW, lr=1e-4)


@dataclass
class Problem:
    """A meta-device model, its example batch (and loss), and how many tokens a step trains on."""

    name: str
    model: nn.Module
    inputs: dict | tuple
    loss: dict
    tokens: int


def gpt2_medium() -> Problem:
    config = GPT2Config(n_layer=24, n_embd=1024, n_head=16, vocab_size=50257, n_positions=1024,
                        bos_token_id=0, eos_token_id=0)
    with torch.device("meta"):
        model = GPT2LMHeadModel(config)
    ids = torch.randint(0, 50257, (32, 1024))
    return Problem("GPT-2 medium (24 x 1024), 32 x 1024 tokens", model, {"input_ids": ids, "labels": ids}, {},
                   ids.numel())


def llama_7b() -> Problem:
    config = LlamaConfig(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=32, vocab_size=32000, max_position_embeddings=2048)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    ids = torch.randint(0, 32000, (16, 2048))
    return Problem("Llama 7B-shaped (32 x 4096), 16 x 2048 tokens", model, {"input_ids": ids, "labels": ids}, {},
                   ids.numel())


def chain() -> Problem:
    with torch.device("meta"):
        model = nn.Sequential(*(m for _ in range(1000) for m in (nn.Linear(1024, 1024), nn.ReLU())))
    x, y = torch.randn(64, 1024), torch.randn(64, 1024)
    return Problem("chain of 1000 x Linear(1024) + ReLU, batch 64", model, (x,),
                   {"loss_fn": F.mse_loss, "example_target": y}, 64)


PROBLEMS = {"gpt2-medium": gpt2_medium, "llama-7b": llama_7b, "chain": chain}


def roofline_s(problem: Problem, plan: sw.Plan, devices: int) -> float:
    """6 N T / (devices x peak), over the bubble efficiency of the chosen plan's depth and microbatches."""
    params = sum(p.numel() for p in problem.model.parameters())
    depth = len({s.position for s in plan.stages})
    efficiency = plan.microbatches / (plan.microbatches + depth - 1)
    return 6 * params * problem.tokens / (devices * PEAK_BF16) / efficiency


def plan_one(problem: Problem, devices: int) -> tuple[sw.Plan, float, float]:
    """The plan, the seconds it took, this process's peak resident memory (MiB) after it."""
    h100 = [sw.Device(f"cuda:{i}", memory=MEMORY, peak_flops=PEAK_BF16, memory_bandwidth=BANDWIDTH)
            for i in range(devices)]
    start = time.perf_counter()
    plan = sw.plan(problem.model, h100, problem.inputs, optimizer=ADAMW, precision="bf16",
                   topology=sw.Topology.uniform(devices, NVLINK), **problem.loss)
    return plan, time.perf_counter() - start, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default=",".join(PROBLEMS), help=f"comma-separated: {', '.join(PROBLEMS)}")
    p.add_argument("--devices", type=int, default=8)
    p.add_argument("--no-pin", action="store_true", help="do not pin OMP/MKL threads to 1")
    args = p.parse_args(argv)
    unknown = set(args.models.split(",")) - set(PROBLEMS)
    if unknown:
        p.error(f"unknown models {sorted(unknown)}; choose from {sorted(PROBLEMS)}")
    return args


def main() -> None:
    args = parse_args()
    console = _common.start(args, width=140, fresh_cache=False)
    hf_logging.set_verbosity_error()
    table = Table(title=f"sw.plan on the meta device for {args.devices} H100-like devices (bf16, AdamW, NVLink)")
    for column in ("model", "plan time (s)", "peak RSS (MiB)", "chosen", "predicted (ms)", "roofline (ms)",
                   "predicted / roofline", "peak device memory (GiB)"):
        table.add_column(column, justify="right")
    for name in args.models.split(","):
        problem = PROBLEMS[name]()
        plan, seconds, rss = plan_one(problem, args.devices)
        depth = len({s.position for s in plan.stages})
        chosen = f"{plan.schedule} P={depth} x{plan.microbatches}"
        bound = roofline_s(problem, plan, args.devices)
        table.add_row(problem.name, f"{seconds:.1f}", f"{rss:.0f}", chosen, f"{plan.predicted_iteration_s * 1e3:.1f}",
                      f"{bound * 1e3:.1f}", f"{plan.predicted_iteration_s / bound:.2f}x",
                      f"{max(plan.predicted_peak_bytes) / 2**30:.1f}")
    console.print(table)


if __name__ == "__main__":
    main()
