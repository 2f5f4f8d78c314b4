"""Step time of compile_stages=True and cuda_graphs=True against the same pipeline without them and eager.

    python bench/compiled_stages.py        # CPU: GPT-2 4 x 128, batch 8 x 64, 2 devices (a few minutes: inductor)
    python bench/compiled_stages.py --device cuda --layers 12 --dim 768 --heads 12 --batch 16 --length 512 \\
        --precision bf16 --devices 1          # GPT-2-small on one GPU, cuda_graphs too (--no-compile: without
                                              # compile_stages, whose compile takes minutes)

The model is bench/_gpt2.py's (Hugging Face GPT-2, vocabulary 1024, random weights, dropout off:
cuda_graphs refuses random ops), AdamW, clip 1.0. Configurations, all in one run:

- eager: one device, the whole batch at once (autocast for bf16), the baseline of the ratios;
- stagewise: `--devices` devices (logical devices on the GPUs present with --device cuda), 4
  microbatches, 1f1b, analytic costs (so every configuration runs the same plan);
- the same with compile_stages=True, and on CUDA with cuda_graphs=True.

The first step of each configuration is reported apart (compile, or eager run then capture on the
next), then `--warmup` untimed steps, then the timed steps in round robin so drift in the machine's
speed affects all alike; medians with each configuration's last loss. With `--lengths` a
compile_stages pipeline and one without then step through the shapes given, each step timed with the
graphs torch.compile made so far (automatic dynamic shapes: a recompile per size that changes).
Nothing is asserted.
"""

from __future__ import annotations

import argparse
import copy
import time

import _common
import _gpt2
import torch
from _gpt2 import ADAMW, Config
from rich.table import Table
from torch._dynamo.utils import counters
from transformers.utils import logging as hf_logging

import stagewise as sw

MICROBATCHES = 4


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=10, help="timed steps per configuration")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per configuration after the first")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--devices", type=int, default=2, help="stagewise's devices")
    p.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--batch", type=int, default=8, help="sequences per step")
    p.add_argument("--length", type=int, default=64, help="tokens per sequence")
    p.add_argument("--no-compile", action="store_true", help="leave compile_stages out (its compile takes minutes)")
    p.add_argument("--lengths", type=str, default="",
                   help="comma-separated batch x length shapes (e.g. 8x48,6x40) a compile_stages pipeline then "
                        "steps through, each timed with the graphs torch.compile made so far")
    p.add_argument("--no-pin", action="store_true", help="do not set OMP_NUM_THREADS=MKL_NUM_THREADS=1")
    args = p.parse_args(argv)
    if args.steps < 1 or args.warmup < 0 or args.devices < 1 or args.batch < MICROBATCHES:
        p.error(f"--steps and --devices must be >= 1, --warmup >= 0, --batch >= {MICROBATCHES}")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device here")
    return args


def pipeline_config(model: torch.nn.Module, ids: torch.Tensor, args: argparse.Namespace, **options: bool) -> Config:
    gpus = max(torch.cuda.device_count(), 1)
    devices = args.devices if ids.device.type == "cpu" else [f"cuda:{i % gpus}" for i in range(args.devices)]
    pipe = sw.compile(model, devices, {"input_ids": ids, "labels": ids}, optimizer=ADAMW, microbatches=MICROBATCHES,
                      clip_grad_norm=1.0, schedule="1f1b", cost="analytic", precision=args.precision, swap="off",
                      **options)

    def step() -> float:
        return pipe.step(input_ids=ids, labels=ids).item()

    given = ", ".join(name for name, on in options.items() if on) or "as compiled"
    return Config(f"stagewise {args.precision}, {args.devices} {ids.device.type} device(s), {given}", step)


def first_steps(configs: list[Config], console) -> tuple[list[Config], list[float]]:
    """Each configuration's first two steps, timed (a compile, or an eager step then a capture); one
    that stagewise refuses (an op CUDA graphs cannot capture) is said and left out."""
    kept, seconds = [], []
    for config in configs:
        start = time.perf_counter()
        try:
            config.step()
            config.step()
        except sw.StagewiseError as error:
            console.print(f"{config.name}: refused, left out: {error}")
            continue
        kept.append(config)
        seconds.append(time.perf_counter() - start)
    return kept, seconds


def new_shapes(model: torch.nn.Module, ids: torch.Tensor, args: argparse.Namespace, console) -> None:
    """A compile_stages pipeline stepped through other shapes: what each new shape costs (a recompile
    with the changed sizes marked dynamic, then none), against the same pipeline without compile."""
    shapes = [(args.batch, args.length)] + [tuple(int(n) for n in s.split("x")) for s in args.lengths.split(",")]
    batches = [torch.randint(0, 1024, shape, device=ids.device) for shape in shapes]
    pipes = [(name, sw.compile(copy.deepcopy(model), args.devices, {"input_ids": ids, "labels": ids},
                               optimizer=ADAMW, microbatches=MICROBATCHES, clip_grad_norm=1.0, schedule="1f1b",
                               cost="analytic", precision=args.precision, compile_stages=compiled))
             for name, compiled in (("compiled", True), ("without", False))]
    for shape, batch in zip(shapes, batches, strict=True):
        row = []
        for name, pipe in pipes:
            start = time.perf_counter()
            loss = pipe.step(input_ids=batch, labels=batch).item()
            row.append(f"{name} {time.perf_counter() - start:.2f} s, loss {loss:.6f}")
        console.print(f"shape {shape[0]} x {shape[1]}: {'; '.join(row)}; graphs compiled so far: "
                      f"{counters['stats']['unique_graphs']}")


def table(configs: list[Config], first: list[float]) -> Table:
    result = Table(title="compiled stages and CUDA graphs: median step time")
    for column in ("configuration", "first 2 steps (s)", "step time (ms)", "/ eager", "/ stagewise", "last loss"):
        result.add_column(column, justify="right")
    eager, plain = configs[0].median_ms, configs[1].median_ms
    for config, seconds in zip(configs, first, strict=True):
        result.add_row(config.name, f"{seconds:.1f}", f"{config.median_ms:.1f}", f"{config.median_ms / eager:.2f}x",
                       f"{config.median_ms / plain:.2f}x", f"{config.loss:.6f}")
    return result


def main() -> None:
    args = parse_args()
    console = _common.start(args, width=130, fresh_cache=False)
    hf_logging.set_verbosity_error()
    if args.device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        console.print(f"GPU: {torch.cuda.get_device_name(0)} x {torch.cuda.device_count()}, torch {torch.__version__}")
    console.print(f"model: GPT-2 {args.layers} layers, d={args.dim}; batch {args.batch} x {args.length}; AdamW; "
                  f"{args.precision}; stagewise: {args.devices} {args.device} device(s), {MICROBATCHES} microbatches, "
                  f"1f1b; first 2 steps apart, then {args.warmup} warm-up + {args.steps} timed steps, round robin")
    torch.manual_seed(0)
    model = _gpt2.gpt2(args.layers, args.dim, args.heads, args.length)
    ids = torch.randint(0, 1024, (args.batch, args.length), device=args.device)
    bf16 = args.precision == "bf16"
    configs = [Config(f"eager {args.precision}, 1 {args.device} device",
                      _gpt2.eager_step(copy.deepcopy(model), ids, bf16)),
               pipeline_config(copy.deepcopy(model), ids, args)]
    if not args.no_compile:
        configs.append(pipeline_config(copy.deepcopy(model), ids, args, compile_stages=True))
    if args.device == "cuda":
        configs.append(pipeline_config(copy.deepcopy(model), ids, args, cuda_graphs=True))
    configs, first = first_steps(configs, console)
    _common.round_robin(configs, args.warmup, args.steps)
    console.print(table(configs, first))
    if args.lengths:
        new_shapes(model, ids, args, console)


if __name__ == "__main__":
    main()
