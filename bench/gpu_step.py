"""Issue 23's GPU step: GPT-2 small trained eagerly and by stagewise on one GPU, side by side.

    python bench/gpu_step.py --device cuda --json /tmp/gpu/gpu_step.json     # ~2 min on one H200
    python bench/gpu_step.py --device cuda --precision bf16 --rows eager,sw4   # trimmed
    python bench/gpu_step.py --device cpu --layers 3 --dim 64 --length 16 --steps 2   # every path, tiny

The model is Hugging Face GPT-2 small by default: 12 layers, d=768, 12 heads, GPT-2's own vocabulary
of 50257 (`--vocab 1024` is bench/precision.py's), random weights, dropout off; batch 16 x 512;
AdamW lr 3e-4 and clip_grad_norm 1.0. Each precision (`--precision fp32,bf16`) trains four ways
(`--rows eager,accum,sw1,sw4`), each on its own copy of the same model and batch:

- eager: plain PyTorch on the whole batch at once;
- accum: plain PyTorch with gradient accumulation over the same 4 microbatches stagewise runs;
- sw1: stagewise on one device (["cuda:0"]), 4 microbatches, 1f1b, cost="analytic";
- sw4: stagewise on 4 logical devices of the one GPU (["cuda:0"] * 4), bench/precision.py's fixed
  split (one stage per device, the head alone on the last), 4 microbatches, 1f1b, cost="analytic".

fp32 is fp32 (TF32 off); bf16 is autocast around eager's forward and precision="bf16" for stagewise.
After the warm-up every row's steps alternate (round robin) so drift affects all alike; each step
ends with torch.cuda.synchronize(). Columns: median step, its ratio to eager and to accum of the
same precision, the last loss (the rows train the same function: equal to rounding), each compile's
seconds (outside the timed steps), the host split of stagewise's last timed step from
`pipe.time_breakdown()` (dispatch / waiting / compute, summed over devices) and the GPU busy time
of one more step: the union of its kernels' and copies' spans in torch.profiler's CUDA trace ("-"
on the CPU). `--json PATH` writes the same figures. Nothing here is asserted.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

import _common
import _gpt2
import torch
from _gpt2 import ADAMW, Config
from rich.table import Table
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity
from transformers.utils import logging as hf_logging

import stagewise as sw

MICROBATCHES, PIPELINE_DEVICES = 4, 4


class Row(Enum):
    """One way of training, as `--rows` names it."""

    EAGER = "eager"
    ACCUM = "accum"
    SW1 = "sw1"
    SW4 = "sw4"


class Precision(Enum):
    """The arithmetic, as `--precision` and stagewise's `precision=` name it."""

    FP32 = "fp32"
    BF16 = "bf16"


TITLES = {Row.EAGER: "eager, whole batch", Row.ACCUM: f"eager, {MICROBATCHES} microbatches accumulated",
          Row.SW1: "stagewise, 1 device", Row.SW4: f"stagewise, {PIPELINE_DEVICES} logical devices"}


@dataclass
class HostSplit:
    """A stagewise step's host seconds on the devices' compute threads, summed over devices, in ms."""

    dispatch_ms: float
    waiting_ms: float
    compute_ms: float


@dataclass
class Measured(Config):
    """A row of the table: its step times and loss (Config), what it is and what was read beside them."""

    row: Row = Row.EAGER
    precision: Precision = Precision.FP32
    pipe: sw.Pipeline | None = None
    compile_s: float | None = None
    host: HostSplit | None = None
    busy_ms: float | None = None


def _choices(kind: type[Enum]) -> Callable[[str], list]:
    def parse(text: str) -> list:
        try:
            return [kind(name.strip()) for name in text.split(",")]
        except ValueError as error:
            raise argparse.ArgumentTypeError(f"{error}; choose from {','.join(k.value for k in kind)}") from None

    return parse


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    p.add_argument("--precision", type=_choices(Precision), default=list(Precision), help="fp32,bf16 or one")
    p.add_argument("--rows", type=_choices(Row), default=list(Row), help="any of eager,accum,sw1,sw4")
    p.add_argument("--steps", type=int, default=10, help="timed steps per row")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per row first")
    p.add_argument("--layers", type=int, default=12, help=f"GPT-2 blocks, at least {PIPELINE_DEVICES - 1}")
    p.add_argument("--dim", type=int, default=768)
    p.add_argument("--heads", type=int, help="attention heads (default: dim / 64, GPT-2's head size)")
    p.add_argument("--vocab", type=int, default=50257)
    p.add_argument("--batch", type=int, default=16, help="sequences per step")
    p.add_argument("--length", type=int, default=512, help="tokens per sequence")
    p.add_argument("--json", type=Path, help="also write the figures here")
    p.add_argument("--no-pin", action="store_true",
                   help="do not set OMP_NUM_THREADS=MKL_NUM_THREADS=1 (some ops in new threads then use every core)")
    args = p.parse_args(argv)
    args.heads = args.heads or max(1, args.dim // 64)
    if args.steps < 1 or args.warmup < 0:
        p.error("--steps must be >= 1 and --warmup >= 0")
    if args.layers < PIPELINE_DEVICES - 1 or args.batch < MICROBATCHES or args.batch % MICROBATCHES:
        p.error(f"--layers must be at least {PIPELINE_DEVICES - 1} and --batch a multiple of {MICROBATCHES}")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device here (--device cpu runs every path at small sizes)")
    return args


def synced(step: Callable[[], float], device: str) -> Callable[[], float]:
    """`step`, returning only once the GPU has finished all it queued (a no-op on the CPU)."""
    if device == "cpu":
        return step

    def step_and_wait() -> float:
        loss = step()
        torch.cuda.synchronize()
        return loss

    return step_and_wait


def eager_row(row: Row, precision: Precision, model: torch.nn.Module, ids: torch.Tensor) -> Measured:
    microbatches = MICROBATCHES if row is Row.ACCUM else 1
    step = _gpt2.eager_step(model, ids, precision is Precision.BF16, microbatches)
    return Measured(f"{TITLES[row]}, {precision.value}", synced(step, ids.device.type), row=row, precision=precision)


def pipeline_row(row: Row, precision: Precision, model: torch.nn.Module, ids: torch.Tensor, layers: int) -> Measured:
    count = PIPELINE_DEVICES if row is Row.SW4 else 1
    device = "cuda:0" if ids.device.type == "cuda" else "cpu"
    split = _gpt2.split_points(layers, count) if count > 1 else None
    start = time.perf_counter()
    pipe = sw.compile(model, [device] * count, {"input_ids": ids, "labels": ids}, optimizer=ADAMW,
                      microbatches=MICROBATCHES, clip_grad_norm=1.0, schedule="1f1b", split_points=split,
                      cost="analytic", precision=precision.value)
    compile_s = time.perf_counter() - start

    def step() -> float:
        return pipe.step(input_ids=ids, labels=ids).item()

    return Measured(f"{TITLES[row]}, {precision.value}", synced(step, ids.device.type), row=row,
                    precision=precision, pipe=pipe, compile_s=compile_s)


def host_split(pipe: sw.Pipeline) -> HostSplit:
    """The last step's host time on the devices' compute threads, summed over devices."""
    rows = pipe.time_breakdown()
    return HostSplit(sum(r.dispatch_s for r in rows) * 1e3, sum(r.waiting_s for r in rows) * 1e3,
                     sum(r.compute_s for r in rows) * 1e3)


def busy_ms(step: Callable[[], float], activity: ProfilerActivity = ProfilerActivity.CUDA,
            device_type: DeviceType = DeviceType.CUDA) -> float | None:
    """How long the device worked in one `step`: the union of its events' spans in a torch.profiler
    trace (kernels overlapping on several streams counted once); None where the trace holds none.
    The CPU's own ops (activity CPU, device type CPU) go the same way, which is how it is tested."""
    with torch.profiler.profile(activities={ProfilerActivity.CPU, activity}) as profile:
        step()
    spans = [(e.time_range.start, e.time_range.end) for e in profile.events() if e.device_type == device_type]
    return covered_us(spans) / 1e3 if spans else None


def covered_us(spans: list[tuple[float, float]]) -> float:
    """The length of the union of (start, end) spans: overlapping and nested ones count once."""
    total, end = 0.0, float("-inf")
    for begin, finish in sorted(spans):
        total += max(0.0, finish - max(begin, end))
        end = max(end, finish)
    return total


def build(args: argparse.Namespace, console) -> list[Measured]:
    """Every row asked for, each on a copy of one model and batch; compile seconds printed as they come."""
    torch.manual_seed(0)
    model = _gpt2.gpt2(args.layers, args.dim, args.heads, args.length, args.vocab)
    ids = torch.randint(0, args.vocab, (args.batch, args.length), device=args.device)
    rows = []
    for precision in args.precision:
        for row in args.rows:
            if row in (Row.EAGER, Row.ACCUM):
                rows.append(eager_row(row, precision, copy.deepcopy(model), ids))
                continue
            rows.append(pipeline_row(row, precision, copy.deepcopy(model), ids, args.layers))
            console.print(f"compiled {rows[-1].name} in {rows[-1].compile_s:.1f} s")
    return rows


def read_beside(rows: list[Measured], device: str) -> None:
    """After the timed steps: each pipeline's host split of its last timed step, then one more step
    of every row under the profiler for the GPU busy time (on the GPU only)."""
    for row in rows:
        if row.pipe is not None:
            row.host = host_split(row.pipe)
    if device == "cuda":
        for row in rows:
            row.busy_ms = busy_ms(row.step)


def ratio(row: Measured, rows: list[Measured], base: Row) -> float | None:
    """`row`'s median step over that of the `base` row of its precision (None if that row was not run)."""
    found = [r for r in rows if r.row is base and r.precision is row.precision]
    return row.median_ms / found[0].median_ms if found else None


def _text(value: float | None, form: str) -> str:
    return "-" if value is None else format(value, form)


def table(rows: list[Measured]) -> Table:
    result = Table(title="GPU step: median ms; host split of stagewise's last step (ms, summed over devices)")
    for column in ("configuration", "step ms", "/ eager", "/ accum", "last loss", "compile s",
                   "dispatch", "waiting", "compute", "GPU busy ms"):
        result.add_column(column, justify="right")
    for row in rows:
        host = row.host
        split = ["-"] * 3 if host is None else [f"{ms:.1f}" for ms in (host.dispatch_ms, host.waiting_ms,
                                                                          host.compute_ms)]
        result.add_row(row.name, f"{row.median_ms:.1f}", _text(ratio(row, rows, Row.EAGER), ".3f"),
                       _text(ratio(row, rows, Row.ACCUM), ".3f"), f"{row.loss:.6f}", _text(row.compile_s, ".1f"),
                       *split, _text(row.busy_ms, ".1f"))
    return result


def figures(args: argparse.Namespace, rows: list[Measured]) -> dict:
    """The run as JSON: the command, the machine and every row's figures."""
    gpu = torch.cuda.get_device_name(0) if args.device == "cuda" else None
    return {"command": _common.command_line(), "device": gpu or "cpu", "torch": torch.__version__,
            "cuda": torch.version.cuda, "load_average": os.getloadavg(), "vocab": args.vocab,
            "batch": [args.batch, args.length], "layers": args.layers, "dim": args.dim, "steps": args.steps,
            "warmup": args.warmup, "microbatches": MICROBATCHES,
            "rows": [{"row": r.row.value, "precision": r.precision.value, "name": r.name, "median_ms": r.median_ms,
                      "step_ms": [s * 1e3 for s in r.seconds], "to_eager": ratio(r, rows, Row.EAGER),
                      "to_accum": ratio(r, rows, Row.ACCUM), "last_loss": r.loss, "compile_s": r.compile_s,
                      "host": None if r.host is None else vars(r.host), "gpu_busy_ms": r.busy_ms} for r in rows]}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    console = _common.start(args, width=170, fresh_cache=False)
    hf_logging.set_verbosity_error()
    torch.set_float32_matmul_precision("highest")  # TF32 off: fp32 is fp32
    torch.backends.cudnn.allow_tf32 = False
    if args.device == "cuda":
        console.print(f"GPU: {torch.cuda.get_device_name(0)}, torch {torch.__version__}, CUDA {torch.version.cuda}")
    console.print(f"model: GPT-2 {args.layers} layers, d={args.dim}, {args.heads} heads, vocabulary {args.vocab}; "
                  f"batch {args.batch} x {args.length}; AdamW + clip 1.0; {MICROBATCHES} microbatches, 1f1b, "
                  f"sw4 split {_gpt2.split_points(args.layers, PIPELINE_DEVICES)}; {args.warmup} warm-up + "
                  f"{args.steps} timed steps per row, round robin")
    rows = build(args, console)
    _common.round_robin(rows, args.warmup, args.steps)
    read_beside(rows, args.device)
    console.print(table(rows))
    if args.json is not None:
        args.json.write_text(json.dumps(figures(args, rows), indent=1))
        console.print(f"figures written to {args.json}")


if __name__ == "__main__":
    main()
