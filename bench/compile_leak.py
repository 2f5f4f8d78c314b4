"""Memory kept per compile: compile, train, save and load a model again and again in one process.

    python bench/compile_leak.py                          # tiny GPT (export), MLP (fx), HF GPT-2 (export)
    python bench/compile_leak.py --models gpt2 --compiles 10 --top 8
    python bench/compile_leak.py --cost profile --no-train --no-save
    PYTHONPATH=/tmp/before python bench/compile_leak.py  # another checkout's stagewise (the last line
                                                          # printed names the one that ran)

Each round builds a fresh model, compiles it (2 devices, 2 microbatches), trains a few steps,
saves the pipeline and loads it back, trains the loaded one, then drops everything. Beside it, the
baseline round does the same with the eager model alone (build, train, save and reload its
state_dict, drop). After `--warmup` rounds (lazy initialisation, torch's own caches, the profile
cache) the script takes a tracemalloc snapshot and the number of live objects of the kinds a
pipeline is made of, runs `--compiles` more rounds, collects garbage and compares: the growth per
round of tracemalloc's traced Python memory, of live GraphModule / StageWorker / Pipeline /
StreamExecutor / tensor objects (tracemalloc does not see a tensor's storage) and of threads.
Issue 10's target: under 0.2 MB per compile.

`--top N` prints the N allocation sites (grouped by traceback, the last stagewise frames and the
allocating line shown) whose memory grew most; an object the process keeps only the latest of
shows as a growth at one traceback and an equal drop at another: the total is what counts.

What may stay for the whole process, bounded (docs/architecture.md, "Memory"): the profile cache is
on disk; per distinct model structure one host-contention measurement (passes/contention.py) and
per optimizer one update-cost measurement (compiler/compile/calibrate.py).
"""

from __future__ import annotations

import argparse
import copy
import gc
import tempfile
import threading
import tracemalloc
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import _common
import torch
import torch.fx as fx
from rich.table import Table

import stagewise as sw
from stagewise.runtime.executor import StreamExecutor
from stagewise.runtime.worker import StageWorker

STEPS, DEVICES, MICROBATCHES = 2, 2, 2
COUNTED: dict[str, type] = {"GraphModule": fx.GraphModule, "StageWorker": StageWorker, "Pipeline": sw.Pipeline,
                            "StreamExecutor": StreamExecutor, "Tensor": torch.Tensor}


@dataclass
class Case:
    """A model family: a fresh model each round, its batches (inputs, target) and loss."""

    name: str
    make: Callable[[], torch.nn.Module]
    batches: list
    loss_fn: Callable | None


@dataclass
class Growth:
    """What one loop kept: bytes per round, live-object and thread counts, and the snapshots."""

    bytes_per_round: float
    objects: dict[str, int]
    threads: int
    before: tracemalloc.Snapshot
    after: tracemalloc.Snapshot


def cases(names: list[str]) -> list[Case]:
    _common.tests_models()  # the repository root on sys.path
    from tests.hf import gpt2, lm_batches  # noqa: PLC0415 - importable only after the line above
    from tests.models.gpt import TinyGPT, lm_loss  # noqa: PLC0415
    from tests.models.mlp import mlp  # noqa: PLC0415

    ids = torch.randint(0, 64, (8, 9))
    x, y = torch.randn(8, 8), torch.randint(0, 5, (8,))
    every = {
        "gpt": Case("tiny GPT (torch.export)", TinyGPT, [((ids[:, :-1],), ids[:, 1:])] * STEPS, lm_loss),
        "mlp": Case("MLP (torch.fx)", mlp, [((x,), y)] * STEPS, torch.nn.functional.cross_entropy),
        "gpt2": Case("HF GPT-2, 4 layers (torch.export)", gpt2, lm_batches(STEPS), None),
    }
    return [every[name] for name in names]


def eager_round(case: Case, directory: Path) -> None:
    """The baseline: the same model built, trained, saved and reloaded eagerly, then dropped."""
    model = case.make()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)  # compile's default optimizer
    for inputs, target in case.batches:
        opt.zero_grad()
        out = model(**inputs) if isinstance(inputs, dict) else model(*inputs)
        loss = case.loss_fn(out, target) if case.loss_fn is not None else out.loss
        loss.backward()
        opt.step()
    torch.save(model.state_dict(), directory / "eager.pt")
    copy.deepcopy(model).load_state_dict(torch.load(directory / "eager.pt"))


def stagewise_round(case: Case, directory: Path, cost: str, train: bool, save: bool) -> None:
    """Compile a fresh model, train it, save it, load it and train the loaded pipeline; drop both."""
    inputs, target = case.batches[0]
    pipe = sw.compile(case.make(), DEVICES, inputs, loss_fn=case.loss_fn, example_target=target,
                      microbatches=MICROBATCHES, cost=cost)
    pipes = [pipe]
    if save:
        pipe.save(directory / "ck")
        pipes.append(sw.load(directory / "ck"))
    for each in pipes if train else ():
        for inputs, target in case.batches:
            kwargs = {"target": target} if case.loss_fn is not None else {}
            each.step(**inputs, **kwargs) if isinstance(inputs, dict) else each.step(*inputs, **kwargs)


def live_counts() -> dict[str, int]:
    """Live objects of each counted kind (by type, subclasses included: fx makes a class per graph)."""
    names = [name for obj in gc.get_objects() for name in _kinds(type(obj))]
    return {name: names.count(name) for name in COUNTED}


def _kinds(cls: type) -> list[str]:
    return [name for name, kind in COUNTED.items() if issubclass(cls, kind)]


def measure(one_round: Callable[[], None], warmup: int, rounds: int) -> Growth:
    """Growth per round after `warmup` rounds, measured over `rounds` more, garbage collected."""
    for _ in range(warmup):
        one_round()
    gc.collect()
    before, counts, threads = tracemalloc.take_snapshot(), live_counts(), threading.active_count()
    for _ in range(rounds):
        one_round()
    gc.collect()
    after = tracemalloc.take_snapshot()
    grown = sum(stat.size_diff for stat in after.compare_to(before, "filename"))
    later = live_counts()
    return Growth(grown / rounds, {k: later[k] - counts[k] for k in COUNTED}, threading.active_count() - threads,
                  before, after)


def top_sites(growth: Growth, count: int) -> list[str]:
    """The `count` tracebacks whose traced memory grew most, each as its last stagewise frames and
    the allocating line."""
    stats = sorted(growth.after.compare_to(growth.before, "traceback"), key=lambda s: -s.size_diff)[:count]
    lines = []
    for stat in stats:
        ours = [f for f in stat.traceback if f.filename.startswith(str(_common.ROOT)) and "/.venv/" not in f.filename]
        where = " <- ".join(f"{Path(f.filename).name}:{f.lineno}" for f in reversed(ours[-3:]))
        last = stat.traceback[-1]
        lines.append(f"{stat.size_diff / 1e3:+9.1f} kB {stat.count_diff:+6d} blocks  {Path(last.filename).name}:"
                     f"{last.lineno} <- {where}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="gpt,mlp,gpt2", help="comma-separated: gpt, mlp, gpt2")
    parser.add_argument("--compiles", type=int, default=5, help="measured rounds per loop")
    parser.add_argument("--warmup", type=int, default=3, help="rounds before the first snapshot")
    parser.add_argument("--cost", default="analytic", choices=("analytic", "profile"))
    parser.add_argument("--no-train", action="store_true", help="compile and drop only, no steps")
    parser.add_argument("--no-save", action="store_true", help="no save / load in the loop")
    parser.add_argument("--top", type=int, default=0, help="print the N allocation sites that grew most")
    parser.add_argument("--no-pin", action="store_true", help="do not re-execute with OMP/MKL threads pinned to 1")
    args = parser.parse_args()
    console = _common.start(args, width=150, fresh_cache=False)
    tracemalloc.start(30 if args.top else 1)
    table = Table(title=f"kept per round (traced MB; live objects and threads) after {args.warmup} warm-up rounds, "
                        f"over {args.compiles} rounds (cost={args.cost!r}, train={not args.no_train}, "
                        f"save/load={not args.no_save})")
    for column in ("model", "loop", "MB", *COUNTED, "threads"):
        table.add_column(column, justify="left" if column in ("model", "loop") else "right")
    sites = []
    with tempfile.TemporaryDirectory(prefix="stagewise-leak-") as tmp:
        directory = Path(tmp)
        for case in cases(args.models.split(",")):
            loops = {"eager (baseline)": lambda c=case: eager_round(c, directory),
                     "stagewise": lambda c=case: stagewise_round(c, directory, args.cost, not args.no_train,
                                                                 not args.no_save)}
            for loop, one_round in loops.items():
                growth = measure(one_round, args.warmup, args.compiles)
                table.add_row(case.name, loop, f"{growth.bytes_per_round / 1e6:.3f}",
                              *(f"{growth.objects[k] / args.compiles:+.1f}" for k in COUNTED), f"{growth.threads:+d}")
                if args.top and loop == "stagewise":
                    sites.append((case.name, top_sites(growth, args.top)))
    console.print(table)
    for name, lines in sites:
        console.print(f"[bold]{name}[/bold]: the allocation sites that grew most over the measured rounds")
        for line in lines:
            console.print("  " + line, highlight=False)
    console.print(f"stagewise imported from {Path(sw.__file__).resolve().parent}, torch {torch.__version__}")


if __name__ == "__main__":
    main()
