"""Dispatch overhead: a tiny model trained eagerly and with stagewise on 1, 2 and 4 in-process CPU devices.

    python bench/overhead.py                        # 1, 2 and 4 devices, 5 warm-up + 100 timed steps (~15 s),
                                                    # then the compute-bound GPT (~30 s)
    python bench/overhead.py --steps 200 --devices 2,4 --gpt-steps 0
    PYTHONPATH=/tmp/before python bench/overhead.py   # another checkout's stagewise (the line
                                                     # "stagewise imported from" names which one ran)

The model (8 x Linear(16, 16), each followed by a ReLU; batch 64; MSE loss; SGD lr 0.01, the
compiler's default optimizer) is so small that a step's compute is negligible: what stagewise adds
above eager training is the cost of running its programs (threads, events, dispatch of each
instruction). Every pipeline is compiled with 16 microbatches, schedule="1f1b" and cost="analytic"
(no profiling), a stage on every device. The figure of merit is microseconds per instruction above
eager: (stagewise step time - eager step time) / instructions executed per step, the instructions
being those of every device's program (sum of len(program.instructions)). Issue 9's target: at
most 50 us on 2 and 4 devices. Part of that figure is not stagewise's: PyTorch's per-op cost of
running 16 microbatches of 4 instead of one batch of 64. A second baseline, eager training over the
same microbatches (gradient accumulation), takes that out; the table gives both.

Timing: one intra-op thread everywhere (pinned, unless --no-pin). Every configuration starts from
the same weights and sees the same batch; after warm-up, steps of the configurations alternate
(round robin) so drift in the machine's speed (other jobs) affects all alike; medians are reported.
The last loss of each configuration is printed beside its times: they must agree with eager's.

The second table is issue 23's other figure: a compute-bound model (GPT, 8 layers x 256 hidden,
batch 16 x 128 tokens, 4 microbatches) on one CPU device against eager training over the same
microbatches (gradient accumulation); the target is a ratio of at most 1.05. Its steps alternate
the same way (few of them: a step is about a second).

Reading the figures: on the 2-core VM this was written on, the pipelines' step times are bimodal,
and a run can sit in either mode: in the slow one 2 and 4 devices step about 1.5x and 2x slower.
The column "CPU s per wall s" (the process's CPU time, every thread, over the step time) tells
them apart: about 1.0 in the fast mode, 1.2 to 1.3 in the slow one, where the devices' threads
run on both cores at once and pass the GIL between them at every PyTorch op (tiny ops gain
nothing from running in parallel, and each pass costs a cross-core wake-up). Pinned to one core
(`taskset -c 0 python bench/overhead.py`) runs are always in the fast mode; other jobs on the
machine move an unpinned run between the modes. Compare two versions of the code pinned, or in
the same mode, run back to back, and check the CPUs printed in the header.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field

import _common
import torch
import torch.nn as nn
import torch.nn.functional as F
from rich.table import Table

import stagewise as sw

WIDTH, DEPTH, BATCH, MICROBATCHES, LEARNING_RATE = 16, 8, 64, 16, 0.01
GPT_LAYERS, GPT_DIM, GPT_BATCH, GPT_TOKENS, GPT_VOCAB, GPT_MICROBATCHES = 8, 256, 16, 128, 256, 4


@dataclass
class Config:
    """One way of training the model: a step function (returns the step's loss) and its instruction count."""

    name: str
    step: Callable[[], float]
    instructions: int
    seconds: list[float] = field(default_factory=list)
    cpu_seconds: list[float] = field(default_factory=list)  # the process's CPU time (every thread) per step
    loss: float = float("nan")

    @property
    def median_s(self) -> float:
        return statistics.median(self.seconds)

    @property
    def median_cpu_s(self) -> float:
        return statistics.median(self.cpu_seconds)

    @property
    def cpu_per_wall(self) -> float:
        """CPU seconds per wall second over the timed steps: about 1 where one core ran the step at a
        time, above 1 where threads ran on several cores at once (and passed the GIL between them)."""
        return sum(self.cpu_seconds) / sum(self.seconds)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=100, help="timed steps per configuration")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps per configuration first")
    p.add_argument("--devices", default="1,2,4", help="comma-separated in-process CPU device counts")
    p.add_argument("--gpt-steps", type=int, default=3, help="timed steps of the compute-bound GPT (0: skip it)")
    p.add_argument("--no-pin", action="store_true",
                   help="do not set OMP_NUM_THREADS=MKL_NUM_THREADS=1 (some ops in new threads then use every core)")
    args = p.parse_args(argv)
    args.devices = [int(d) for d in args.devices.split(",")]
    if args.steps < 1 or args.warmup < 0 or args.gpt_steps < 0 or any(d < 1 for d in args.devices):
        p.error("--steps must be >= 1, --warmup and --gpt-steps >= 0 and every device count >= 1")
    return args


def make_model() -> nn.Module:
    layers: list[nn.Module] = []
    for _ in range(DEPTH):
        layers += [nn.Linear(WIDTH, WIDTH), nn.ReLU()]
    return nn.Sequential(*layers)


def eager_config(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> Config:
    optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)

    def step() -> float:
        optimizer.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        return loss.item()

    return Config("eager", step, instructions=0)


def accumulating_config(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> Config:
    """Eager training over the pipelines' microbatches (gradient accumulation): the PyTorch per-op cost
    of running 16 small microbatches instead of one batch, which stagewise pays too, without its dispatch."""
    return Config(f"eager, {MICROBATCHES} microbatches", accumulating_step(model, F.mse_loss, x, y, MICROBATCHES),
                  instructions=0)


def accumulating_step(model: nn.Module, loss_fn, x: torch.Tensor, y: torch.Tensor, microbatches: int):
    """One SGD step of eager training that accumulates the gradients of `microbatches` chunks."""
    optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)

    def step() -> float:
        optimizer.zero_grad()
        total = torch.zeros(())
        for xs, ys in zip(x.chunk(microbatches), y.chunk(microbatches), strict=True):
            loss = loss_fn(model(xs), ys) / microbatches
            loss.backward()
            total += loss.detach()
        optimizer.step()
        return total.item()

    return step


def pipeline_config(model: nn.Module, devices: int, x: torch.Tensor, y: torch.Tensor) -> Config:
    pipe = sw.compile(model, devices, (x,), loss_fn=F.mse_loss, example_target=y, microbatches=MICROBATCHES,
                      schedule="1f1b", cost="analytic")
    instructions = sum(len(program.instructions) for program in pipe.programs)

    def step() -> float:
        return pipe.step(x, target=y).item()

    return Config(f"{devices} device{'s' if devices > 1 else ''}", step, instructions)


def per_instruction_us(config: Config, baseline: Config, cpu: bool = False) -> str:
    """Microseconds per instruction of `config` above `baseline`'s step time ("-" for eager configs);
    `cpu`: of the process's CPU time instead, which other jobs on the machine move far less than the wall time."""
    if not config.instructions:
        return "-"
    above = config.median_cpu_s - baseline.median_cpu_s if cpu else config.median_s - baseline.median_s
    return f"{above / config.instructions * 1e6:.1f}"


def table(configs: list[Config]) -> Table:
    """configs: eager, eager over microbatches, then the pipelines."""
    eager, accumulating = configs[0], configs[1]
    result = Table(title="dispatch overhead: median step time and microseconds per instruction above eager")
    for column in ("configuration", "step time (ms)", "instructions per step", "us per instruction above eager",
                   f"us per instruction above eager, {MICROBATCHES} microbatches",
                   f"CPU us per instruction above eager, {MICROBATCHES} microbatches", "CPU s per wall s", "last loss"):
        result.add_column(column, justify="right")
    for config in configs:
        instructions = str(config.instructions) if config.instructions else "-"
        result.add_row(config.name, f"{config.median_s * 1e3:.3f}", instructions, per_instruction_us(config, eager),
                       per_instruction_us(config, accumulating), per_instruction_us(config, accumulating, cpu=True),
                       f"{config.cpu_per_wall:.2f}", f"{config.loss:.6f}")
    return result


def gpt_configs() -> list[Config]:
    """Issue 23's compute-bound model on one CPU device: eager over the microbatches, then stagewise."""
    gpt = _common.tests_models()
    torch.manual_seed(0)
    model = gpt.TinyGPT(vocab=GPT_VOCAB, dim=GPT_DIM, heads=4, layers=GPT_LAYERS, context=GPT_TOKENS, tie=False)
    ids = torch.randint(0, GPT_VOCAB, (GPT_BATCH, GPT_TOKENS + 1))
    x, y = ids[:, :-1], ids[:, 1:]
    eager, pipeline = copy.deepcopy(model), copy.deepcopy(model)
    eager_step = accumulating_step(eager, gpt.lm_loss, x, y, GPT_MICROBATCHES)
    pipe = sw.compile(pipeline, 1, (x,), loss_fn=gpt.lm_loss, example_target=y, microbatches=GPT_MICROBATCHES,
                      schedule="1f1b", cost="analytic")
    instructions = sum(len(program.instructions) for program in pipe.programs)
    return [Config(f"eager, {GPT_MICROBATCHES} microbatches", eager_step, instructions=0),
            Config("1 device", lambda: pipe.step(x, target=y).item(), instructions)]


def gpt_table(configs: list[Config]) -> Table:
    eager, pipeline = configs
    result = Table(title=f"compute-bound GPT ({GPT_LAYERS} x {GPT_DIM}, batch {GPT_BATCH} x {GPT_TOKENS}) "
                         "on one CPU device: median step time")
    for column in ("configuration", "step time (ms)", "instructions per step", "x eager (target <= 1.05)",
                   "last loss"):
        result.add_column(column, justify="right")
    for config in configs:
        result.add_row(config.name, f"{config.median_s * 1e3:.1f}", str(config.instructions or "-"),
                       f"{config.median_s / eager.median_s:.3f}" if config is pipeline else "-", f"{config.loss:.6f}")
    return result


def main() -> None:
    args = parse_args()
    console = _common.start(args, width=140, fresh_cache=False)
    console.print(f"stagewise imported from {os.path.dirname(sw.__file__)}; this process may run on CPUs "
                  f"{sorted(os.sched_getaffinity(0))}")
    console.print(f"model: {DEPTH} x (Linear({WIDTH}, {WIDTH}) + ReLU), batch {BATCH}, MSE, SGD lr {LEARNING_RATE}; "
                  f"stagewise: {MICROBATCHES} microbatches, schedule='1f1b', cost='analytic'; "
                  f"{args.warmup} warm-up + {args.steps} timed steps per configuration, round robin")
    torch.manual_seed(0)
    model = make_model()
    x, y = torch.randn(BATCH, WIDTH), torch.randn(BATCH, WIDTH)
    configs = [eager_config(copy.deepcopy(model), x, y), accumulating_config(copy.deepcopy(model), x, y)]
    configs += [pipeline_config(copy.deepcopy(model), devices, x, y) for devices in args.devices]
    _common.round_robin(configs, args.warmup, args.steps)
    console.print(table(configs))
    if args.gpt_steps:
        gpt = gpt_configs()
        _common.round_robin(gpt, 1, args.gpt_steps)
        console.print(gpt_table(gpt))
    console.print(f"us per instruction above eager = (step time - eager step time) / instructions per step "
                  f"(every device's program); the next column subtracts eager training over the same "
                  f"{MICROBATCHES} microbatches (gradient accumulation) instead, which leaves stagewise's own "
                  f"dispatch; the CPU column takes the process's CPU time (every thread) instead of the wall time, "
                  f"which a loaded machine inflates far less. Machine afterwards: load average {os.getloadavg()[0]:.2f}; "
                  f"{os.cpu_count()} cores, so 4 devices' threads share cores.")


if __name__ == "__main__":
    main()
