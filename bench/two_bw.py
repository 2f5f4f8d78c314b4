"""PipeDream-2BW next to 1F1B on 2 in-process CPU devices: step time and the loss over the steps.

    python bench/two_bw.py                      # 200 steps each, alternating, loss every 25
    python bench/two_bw.py --steps 50 --every 10

The model is the test zoo's GPT (tests/models/gpt.py: tied embedding and head), d=128, 4 blocks,
vocabulary 256, batch 16 x 32 tokens, cut at blocks.2 for both schedules, AdamW (lr 1e-3), 4
microbatches, analytic costs, trained on 8 fixed batches in turn so the loss falls. Both start from
the same weights and see the same batches; the schedules' steps alternate (round robin), so drift
in the machine's speed affects both alike.

1F1B trains like eager synchronous SGD; 2bw (issue 25 item 3, Narayanan §3.2.1) keeps two weight
versions and updates with gradients one step stale, so its loss curve differs (by the paper's
measurements, little). Here every `pipe.step` drains the pipeline under both schedules (the next
batch is not known before the call returns): 2bw's step is 1F1B's order plus the version copy in
its update, so the throughput column is expected near 1.0x, not the paper's no-flush gain.
Nothing here is asserted.
"""

from __future__ import annotations

import argparse
import copy
import functools
import statistics
import time

import _common
import torch
from rich.table import Table

import stagewise as sw

SCHEDULES = {"1f1b": {}, "2bw": {"asynchronous": True}}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200, help="steps per schedule (the first 3 are not timed)")
    p.add_argument("--every", type=int, default=25, help="print the losses every this many steps")
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--no-pin", action="store_true",
                   help="do not set OMP_NUM_THREADS=MKL_NUM_THREADS=1 (some ops in new threads then use every core)")
    args = p.parse_args(argv)
    if args.steps < 4 or args.every < 1 or args.microbatches < 1:
        p.error("--steps must be >= 4, --every and --microbatches >= 1")
    return args


def compiled(microbatches: int) -> tuple[dict[str, sw.Pipeline], list[tuple[torch.Tensor, torch.Tensor]]]:
    gpt = _common.tests_models()
    torch.manual_seed(0)
    model = gpt.TinyGPT(vocab=256, dim=128, heads=4, layers=4, context=32)
    tokens = [torch.randint(0, 256, (16, 33)) for _ in range(8)]
    batches = [(t[:, :-1], t[:, 1:]) for t in tokens]
    pipes = {schedule: sw.compile(copy.deepcopy(model), 2, (batches[0][0],), loss_fn=gpt.lm_loss,
                                  example_target=batches[0][1], optimizer=functools.partial(torch.optim.AdamW, lr=1e-3),
                                  microbatches=microbatches, schedule=schedule, split_points=["blocks.2"],
                                  cost="analytic", **options)
             for schedule, options in SCHEDULES.items()}
    return pipes, batches


def train(pipes: dict[str, sw.Pipeline], batches, steps: int) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Per schedule, every step's loss and the timed steps' seconds (round robin)."""
    losses: dict[str, list[float]] = {s: [] for s in pipes}
    seconds: dict[str, list[float]] = {s: [] for s in pipes}
    for step in range(steps):
        ids, target = batches[step % len(batches)]
        for schedule, pipe in pipes.items():
            start = time.perf_counter()
            losses[schedule].append(pipe.step(ids, target=target).item())
            if step >= 3:
                seconds[schedule].append(time.perf_counter() - start)
    return losses, seconds


def tables(pipes: dict[str, sw.Pipeline], losses: dict[str, list[float]], seconds: dict[str, list[float]],
           every: int) -> tuple[Table, Table]:
    speed = Table(title="2bw next to 1f1b: 2 CPU devices, the same split (median step)")
    for column in ("schedule", "step", "throughput vs 1f1b", "simulated step"):
        speed.add_column(column)
    base = statistics.median(seconds["1f1b"])
    for schedule, timed in seconds.items():
        step = statistics.median(timed)
        simulated = pipes[schedule].simulate().iteration_time
        speed.add_row(schedule, f"{step * 1e3:.1f} ms", f"{base / step:.3f}x", f"{simulated * 1e3:.1f} ms")
    curve = Table(title=f"loss every {every} steps (1f1b: synchronous; 2bw: one-step-stale updates)")
    for column in ("step", *losses, "2bw - 1f1b"):
        curve.add_column(column)
    for step in [*range(0, len(losses["1f1b"]), every), len(losses["1f1b"]) - 1]:
        a, b = losses["1f1b"][step], losses["2bw"][step]
        curve.add_row(str(step + 1), f"{a:.4f}", f"{b:.4f}", f"{b - a:+.4f}")
    return speed, curve


def main() -> None:
    args = parse_args()
    console = _common.start(args, width=120, fresh_cache=False)
    pipes, batches = compiled(args.microbatches)
    console.print(f"GPT d=128, 4 blocks, batch 16 x 32, {args.microbatches} microbatches, AdamW; {args.steps} steps "
                  "per schedule, alternating")
    losses, seconds = train(pipes, batches, args.steps)
    speed, curve = tables(pipes, losses, seconds, args.every)
    console.print(speed)
    console.print(curve)


if __name__ == "__main__":
    main()
