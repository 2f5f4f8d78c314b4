"""1F1B, interleaved, ZB-H1 and ZB-V on 2 in-process CPU devices: step time, simulated and measured bubble, peak memory.

    python bench/zero_bubble.py                 # 3 warm-up + 15 timed steps per schedule
    python bench/zero_bubble.py --steps 40 --microbatches 8

The model is the test zoo's GPT (tests/models/gpt.py: tied embedding and head) widened so that compute
dominates (d=256, 4 blocks, vocabulary 512), batch 16 x 64 tokens, SGD, analytic costs. The model is cut
into four chunks at blocks 1, 2 and 3: 1F1B and ZB-H1 run two stages (chunks 0-1 and 2-3, one per
device), interleaved and ZB-V the four chunks, two per device (interleaved: chunks 0 and 2 on dev0;
ZB-V's V: chunks 0 and 3). So each device computes the same layers' passes under every schedule, and
only their order differs: 1F1B runs each backward whole, ZB-H1 splits it into its input gradient (B) and
weight gradient (W) and runs stage 1's first W passes later (issue 25; Qi et al. §2.1), ZB-V splits
them too and orders the V's passes so that W fills what is left of the bubble (§6).

Per schedule: the median step (the schedules' steps alternate, round robin, so drift in the machine's
speed affects both alike), the simulator's predicted iteration and bubble (idle over the busiest
device's compute), the measured bubble (each device's step less its compute thread's compute, over
the busiest device's compute; `pipe.time_breakdown()`), each device's peak pool bytes, and the last
loss (equal: the gradients are the same bits). Between a microbatch's B and its W the stage keeps
its whole stash, so under ZB-H1 the last stage holds 2 stashes where 1F1B's holds 1: the peak of a
stage whose stash is the largest (here the head's, with its logits) grows. Nothing here is asserted.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from dataclasses import dataclass, field

import _common
import torch
from rich.table import Table

import stagewise as sw
from stagewise.ir.devices import format_bytes

CHUNKS = ["blocks.1", "blocks.2", "blocks.3"]  # four chunks; a two-stage plan cuts at the middle one
SPLITS = {"1f1b": ["blocks.2"], "interleaved": CHUNKS, "zb-h1": ["blocks.2"], "zb-v": CHUNKS}


@dataclass
class Run:
    """One schedule's pipeline and what its steps measured."""

    schedule: str
    pipe: sw.Pipeline
    seconds: list[float] = field(default_factory=list)
    bubbles: list[float] = field(default_factory=list)
    loss: float = float("nan")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=15, help="timed steps per schedule")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--no-pin", action="store_true",
                   help="do not set OMP_NUM_THREADS=MKL_NUM_THREADS=1 (some ops in new threads then use every core)")
    args = p.parse_args(argv)
    if args.steps < 1 or args.warmup < 0 or args.microbatches < 1:
        p.error("--steps and --microbatches must be >= 1, --warmup >= 0")
    return args


def compile_runs(microbatches: int) -> tuple[list[Run], torch.Tensor, torch.Tensor]:
    gpt = _common.tests_models()
    torch.manual_seed(0)
    model = gpt.TinyGPT(vocab=512, dim=256, heads=4, layers=4, context=64)
    tokens = torch.randint(0, 512, (16, 65))
    ids, target = tokens[:, :-1], tokens[:, 1:]  # next-token prediction
    runs = []
    for schedule, split in SPLITS.items():
        pipe = sw.compile(copy.deepcopy(model), 2, (ids,), loss_fn=gpt.lm_loss, example_target=target,
                          optimizer=lambda params: torch.optim.SGD(params, lr=1e-4), microbatches=microbatches,
                          schedule=schedule, split_points=split, cost="analytic")
        runs.append(Run(schedule, pipe))
    return runs, ids, target


def measured_bubble(pipe: sw.Pipeline) -> float:
    """The last step's idle time on the busiest device over its compute (the simulator's definition)."""
    rows = pipe.time_breakdown()
    busiest = max(rows, key=lambda row: row.compute_s)
    return (busiest.step_s - busiest.compute_s) / busiest.compute_s


def measure(runs: list[Run], ids: torch.Tensor, target: torch.Tensor, warmup: int, steps: int) -> None:
    for _ in range(warmup):
        for run in runs:
            run.pipe.step(ids, target=target)
    for _ in range(steps):
        for run in runs:
            start = time.perf_counter()
            run.loss = run.pipe.step(ids, target=target).item()
            run.seconds.append(time.perf_counter() - start)
            run.bubbles.append(measured_bubble(run.pipe))


def table(runs: list[Run]) -> Table:
    out = Table(title="1F1B, interleaved, ZB-H1, ZB-V: 2 CPU devices, the same layers per device (medians)")
    for column in ("schedule", "step", "vs 1f1b", "simulated step", "simulated bubble", "measured bubble",
                   "peak dev0 / dev1", "last loss"):
        out.add_column(column)
    base = statistics.median(runs[0].seconds)
    for run in runs:
        step = statistics.median(run.seconds)
        predicted = run.pipe.simulate()
        peaks = " / ".join(format_bytes(row["peak_bytes"]) for row in run.pipe.stats)
        out.add_row(run.schedule, f"{step * 1e3:.1f} ms", f"{base / step:.3f}x throughput",
                    f"{predicted.iteration_time * 1e3:.1f} ms", f"{predicted.bubble_fraction:.3f}",
                    f"{statistics.median(run.bubbles):.3f}", peaks, f"{run.loss:.6f}")
    return out


def main() -> None:
    args = parse_args()
    console = _common.start(args, width=140, fresh_cache=False)
    runs, ids, target = compile_runs(args.microbatches)
    console.print(f"GPT d=256, 4 blocks, batch 16 x 64, {args.microbatches} microbatches; "
                  f"{args.warmup} warm-up + {args.steps} timed steps per schedule, alternating")
    measure(runs, ids, target, args.warmup, args.steps)
    console.print(table(runs))


if __name__ == "__main__":
    main()
