"""Step time of precision="bf16" against "fp32" on the demo model, with eager baselines side by side.

    python bench/precision.py                 # 3 warm-up + 20 timed steps per configuration (~1 min)
    python bench/precision.py --steps 50
    python bench/precision.py --device cuda --layers 12 --dim 768 --heads 12 --length 512   # on one GPU

The model is examples/demo.py's: Hugging Face GPT-2 (6 layers, d=128, 4 heads, vocabulary 1024,
random weights), batch 16 x 32 tokens, AdamW lr 3e-4, clip_grad_norm 1.0. Four configurations:

- eager fp32 and eager bf16 (`torch.autocast("cpu", torch.bfloat16)` around the forward, fp32
  weights and optimizer): one device, the whole batch at once;
- stagewise fp32 and stagewise bf16 (`precision="bf16"`): 4 in-process CPU devices, 4 microbatches,
  schedule 1f1b, the same fixed split (one stage per device) and analytic costs, so both precisions
  run the same plan and only the arithmetic differs.

With `--device cuda` eager runs on cuda:0 and the 4 stagewise devices are 4 logical devices on the
GPUs present (several on one GPU when there are fewer), autocast on "cuda"; TF32 stays off, so fp32
is fp32. Model and batch sizes are options (the defaults are the demo's).

On CPUs without native bf16 matmuls (no AMX / AVX512-BF16), autocast's bf16 kernels convert and
can be slower than fp32: the bench reports what this machine does, not what bf16 is for (a GPU's
tensor cores). Timing: one intra-op thread everywhere (pinned unless --no-pin); after warm-up the
configurations' steps alternate (round robin) so drift in the machine's speed affects all alike;
medians are reported with each configuration's last loss. Nothing here is asserted.
"""

from __future__ import annotations

import argparse
import copy

import _common
import _gpt2
import torch
from _gpt2 import ADAMW, Config
from rich.table import Table
from transformers import GPT2LMHeadModel
from transformers.utils import logging as hf_logging

import stagewise as sw

DEVICES, MICROBATCHES = 4, 4


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=20, help="timed steps per configuration")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per configuration first")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--layers", type=int, default=6, help="GPT-2 blocks, at least 3")
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--batch", type=int, default=16, help="sequences per step")
    p.add_argument("--length", type=int, default=32, help="tokens per sequence")
    p.add_argument("--no-pin", action="store_true",
                   help="do not set OMP_NUM_THREADS=MKL_NUM_THREADS=1 (some ops in new threads then use every core)")
    args = p.parse_args(argv)
    if args.steps < 1 or args.warmup < 0:
        p.error("--steps must be >= 1 and --warmup >= 0")
    if args.layers < DEVICES - 1 or args.batch < MICROBATCHES:
        p.error(f"--layers must be at least {DEVICES - 1} and --batch at least {MICROBATCHES}")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device here")
    return args


def split_points(layers: int) -> list[str]:
    """One stage per device (the demo's 6 blocks: split after blocks 1, 3 and 5)."""
    return _gpt2.split_points(layers, DEVICES)


def eager_config(model: GPT2LMHeadModel, ids: torch.Tensor, bf16: bool) -> Config:
    step = _gpt2.eager_step(model, ids, bf16)
    return Config(f"eager {'bf16 (autocast)' if bf16 else 'fp32'}, 1 {ids.device.type} device", step)


def pipeline_config(model: GPT2LMHeadModel, ids: torch.Tensor, precision: str, layers: int) -> Config:
    gpus = max(torch.cuda.device_count(), 1)
    devices = DEVICES if ids.device.type == "cpu" else [f"cuda:{i % gpus}" for i in range(DEVICES)]
    pipe = sw.compile(model, devices, {"input_ids": ids, "labels": ids}, optimizer=ADAMW, microbatches=MICROBATCHES,
                      clip_grad_norm=1.0, schedule="1f1b", split_points=split_points(layers), cost="analytic",
                      precision=precision)

    def step() -> float:
        return pipe.step(input_ids=ids, labels=ids).item()

    return Config(f"stagewise {precision}, {DEVICES} {ids.device.type} devices", step)


def table(configs: list[Config]) -> Table:
    """configs: eager fp32, eager bf16, stagewise fp32, stagewise bf16 (each bf16 against the fp32 before it)."""
    result = Table(title="bf16 against fp32: median step time")
    for column in ("configuration", "step time (ms)", "bf16 / fp32", "last loss"):
        result.add_column(column, justify="right")
    for index, config in enumerate(configs):
        ratio = f"{config.median_ms / configs[index - 1].median_ms:.2f}x" if index % 2 else "-"
        result.add_row(config.name, f"{config.median_ms:.1f}", ratio, f"{config.loss:.6f}")
    return result


def main() -> None:
    args = parse_args()
    console = _common.start(args, width=120, fresh_cache=False)
    hf_logging.set_verbosity_error()
    if args.device == "cpu":
        console.print(f"CPU bf16 support (torch.backends.mkldnn): {torch.backends.mkldnn.is_available()}, "
                      f"native bf16 kernels: {torch.ops.mkldnn._is_mkldnn_bf16_supported()}")
    else:
        console.print(f"GPU: {torch.cuda.get_device_name(0)} x {torch.cuda.device_count()}, torch {torch.__version__}")
    console.print(f"model: GPT-2 {args.layers} layers, d={args.dim}, vocabulary 1024; batch {args.batch} x "
                  f"{args.length}; AdamW + clipping; stagewise: {DEVICES} {args.device} devices, {MICROBATCHES} "
                  f"microbatches, 1f1b, split {split_points(args.layers)}; "
                  f"{args.warmup} warm-up + {args.steps} timed steps per configuration, round robin")
    torch.manual_seed(0)
    model = _gpt2.gpt2(args.layers, args.dim, args.heads, args.length)
    ids = torch.randint(0, 1024, (args.batch, args.length), device=args.device)
    configs = [eager_config(copy.deepcopy(model), ids, bf16=False), eager_config(copy.deepcopy(model), ids, bf16=True),
               pipeline_config(copy.deepcopy(model), ids, "fp32", args.layers),
               pipeline_config(copy.deepcopy(model), ids, "bf16", args.layers)]
    _common.round_robin(configs, args.warmup, args.steps)
    console.print(table(configs))


if __name__ == "__main__":
    main()
