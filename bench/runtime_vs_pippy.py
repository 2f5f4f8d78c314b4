"""stagewise vs torch.distributed.pipelining: the same model, split, schedule and training, 2 ranks over gloo.

    python bench/runtime_vs_pippy.py                  # both models (about 5 minutes on 2 CPU cores)
    python bench/runtime_vs_pippy.py --models small   # the first model alone (about 1-2 minutes)
    python bench/runtime_vs_pippy.py --quick          # smoke run (about 1 minute)
    torchrun --standalone --nproc-per-node 2 bench/runtime_vs_pippy.py   # the same under torchrun

Two models, one after the other (`MODELS`): "small" (8 blocks, d=128, 64 tokens: the runtime's own
cost shows) and "large" (8 blocks, d=256, 128 tokens, a 2048 vocabulary, 4x the parameters and about
8x the FLOPs per step: the kernels dominate). Both systems train one GPT-style model (untied LM head, so the graph has no tensor shared across
the cut) cut in two at the same block (`split_points=[blocks.k]` for stagewise,
`split_spec={"blocks.k": SplitPoint.BEGINNING}` for `torch.distributed.pipelining.pipeline`), one
stage per rank, with the same schedule (GPipe, then 1F1B), the same microbatches, the same loss
(next-token cross entropy, mean over each microbatch, gradients averaged over microbatches) and the
same optimizer (AdamW, one step per minibatch). Both start from the same weights and see the same
batches, so their losses must agree; the first and last loss of each is printed as a check.

Timing: each rank uses one intra-op thread (two ranks on two cores). Every timed step is framed
by `dist.barrier()` on both ranks and timed on rank 0, for both systems alike, so a step's time is
that of the slower rank. Steps of the two systems alternate after warm-up, so drift in the
machine's speed affects both equally. Reported: median step time, samples/s (sequences per
second) and the throughput ratio stagewise / pippy. Below each model's table, where stagewise's
step went on each rank (`pipe.time_breakdown()`, medians): compute, waiting for the other rank
(the pipeline's bubble and the messages), and the runtime's own dispatch; and pippy's step over the
busiest rank's compute, a bound on what any runtime could gain on this split (it ignores the bubble).

If pippy's tracer cannot split the model, the script builds the two stage modules by hand and
uses `PipelineStage` (its manual frontend), and says so in the output.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import functools
import os
import shlex
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable

import _common
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F

RANKS = 2
# each model's sizes and default timed steps (--steps overrides); "large" steps about 8x the FLOPs of "small"
MODELS = {
    "small": {"layers": 8, "dim": 128, "heads": 4, "seq": 64, "vocab": 1024, "steps": 60},
    "large": {"layers": 8, "dim": 256, "heads": 8, "seq": 128, "vocab": 2048, "steps": 15},
}
SIZES = ("layers", "dim", "heads", "seq", "vocab")
BREAKDOWN = ("step_s", "compute_s", "waiting_s", "dispatch_s", "inline_s")  # DeviceTime fields reported


# ---- the model: a GPT-style stack with an untied head -------------------------------------------
def GPT(vocab: int, dim: int, heads: int, layers: int, context: int) -> nn.Module:  # noqa: N802 - reads as a class
    """The test zoo's GPT (tests/models/gpt.py) with an untied head: nothing is shared across the cut."""
    return _common.tests_models().TinyGPT(vocab=vocab, dim=dim, heads=heads, layers=layers, context=context, tie=False)


class FirstHalf(nn.Module):
    """Hand-built stage 0 for pippy's manual frontend (used only if its tracer fails)."""

    def __init__(self, model: nn.Module, cut: int):
        super().__init__()
        self.tok, self.pos = model.tok, model.pos
        self.blocks = nn.ModuleList(model.blocks[:cut])

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return x


class SecondHalf(nn.Module):
    def __init__(self, model: nn.Module, cut: int):
        super().__init__()
        self.blocks = nn.ModuleList(model.blocks[cut:])
        self.ln_f, self.head = model.ln_f, model.head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy, mean over the tokens of the (micro)batch."""
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


# ---- options --------------------------------------------------------------------------------------
def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="smoke run: fewer steps, one schedule pass (~1 min)")
    p.add_argument("--models", default="small,large", help=f"comma-separated, from {','.join(MODELS)}")
    p.add_argument("--schedules", default="gpipe,1f1b", help="comma-separated, from gpipe,1f1b")
    for size in SIZES:
        p.add_argument(f"--{size}", type=int, default=None, help=f"every model's {size} (default: the model's)")
    p.add_argument("--batch", type=int, default=16, help="sequences per minibatch")
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--steps", type=int, default=None, help="timed steps per system and schedule (default: the model's)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--threads", type=int, default=1, help="intra-op threads per rank")
    p.add_argument("--pippy-manual", action="store_true",
                   help="build pippy's stages by hand (PipelineStage) instead of tracing with pipeline()")
    args = p.parse_args(argv)
    if args.quick:
        args.steps, args.warmup = 3, 1
    args.schedules = [s.strip() for s in args.schedules.split(",") if s.strip()]
    for s in args.schedules:
        if s not in ("gpipe", "1f1b"):
            p.error(f"unknown schedule {s!r}")
    args.models = [m.strip() for m in args.models.split(",") if m.strip()]
    for m in args.models:
        if m not in MODELS:
            p.error(f"unknown model {m!r}: choose from {', '.join(MODELS)}")
    return args


def model_args(args: argparse.Namespace, name: str) -> argparse.Namespace:
    """The options of one model's run: its sizes and steps unless the command line set them."""
    preset = MODELS[name]
    sizes = {size: preset[size] if getattr(args, size) is None else getattr(args, size) for size in SIZES}
    return argparse.Namespace(**{**vars(args), **sizes, "model": name,
                                 "steps": preset["steps"] if args.steps is None else args.steps})


def command_line() -> str:
    if os.environ.get("TORCHELASTIC_RUN_ID") is not None or "LOCAL_WORLD_SIZE" in os.environ:
        return "torchrun --standalone --nproc-per-node 2 " + shlex.join(sys.argv)
    return shlex.join(["python", *sys.argv])


# ---- the two systems on one rank ------------------------------------------------------------------
def make_model(args) -> nn.Module:
    torch.manual_seed(0)
    return GPT(args.vocab, args.dim, args.heads, args.layers, args.seq)


def make_batches(args, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Sequences of a fixed random bigram chain (token t+1 = perm[token t]): learnable, so the loss falls."""
    g = torch.Generator().manual_seed(1)
    perm = torch.randperm(args.vocab, generator=g)
    out = []
    for _ in range(n):
        ids = torch.empty(args.batch, args.seq + 1, dtype=torch.long)
        ids[:, 0] = torch.randint(0, args.vocab, (args.batch,), generator=g)
        for t in range(args.seq):
            ids[:, t + 1] = perm[ids[:, t]]
        out.append((ids[:, :-1].contiguous(), ids[:, 1:].contiguous()))
    return out


def optimizer_factory(args):
    return functools.partial(torch.optim.AdamW, lr=args.lr)


class Stagewise:
    name = "stagewise"

    def __init__(self, args, schedule: str, cut: int, example):
        import stagewise as sw

        ids, target = example
        self.pipe = sw.compile(make_model(args), RANKS, (ids,), loss_fn=lm_loss, example_target=target,
                               optimizer=optimizer_factory(args), microbatches=args.microbatches,
                               schedule=schedule, split_points=[f"blocks.{cut}"])
        self.how = f"sw.compile(split_points=['blocks.{cut}'], schedule={schedule!r})"

    def step(self, ids, target) -> float:
        return float(self.pipe.step(ids, target=target))

    def breakdown(self) -> dict[str, float]:
        """Where the last step went on this rank's device (runtime/device_time.py), in seconds."""
        row = self.pipe.time_breakdown()[0]
        return {name: row[name] for name in BREAKDOWN}


class Pippy:
    name = "pippy"

    def __init__(self, args, schedule: str, cut: int, example, rank: int):
        from torch.distributed.pipelining import (
            PipelineStage,
            Schedule1F1B,
            ScheduleGPipe,
            SplitPoint,
            pipeline,
        )

        ids, _ = example
        mb = ids.chunk(args.microbatches)[0]
        model = make_model(args)
        try:
            if args.pippy_manual:
                raise RuntimeError("--pippy-manual asked for the manual frontend")
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                pipe = pipeline(copy.deepcopy(model), mb_args=(mb,), split_spec={f"blocks.{cut}": SplitPoint.BEGINNING})
            if pipe.num_stages != RANKS:
                raise RuntimeError(f"the tracer made {pipe.num_stages} stages, not {RANKS}")
            self.stage = pipe.build_stage(rank, torch.device("cpu"))
            self.how = f"pipeline(split_spec={{'blocks.{cut}': BEGINNING}}) + build_stage (traced)"
        except Exception as error:  # noqa: BLE001 - fall back to the manual frontend and say so
            module = FirstHalf(model, cut) if rank == 0 else SecondHalf(model, cut)
            example_in = mb if rank == 0 else torch.zeros(mb.shape[0], mb.shape[1], args.dim)
            self.stage = PipelineStage(module, rank, RANKS, torch.device("cpu"), input_args=(example_in,))
            self.how = f"hand-built FirstHalf/SecondHalf + PipelineStage (traced path not used: {str(error)[:90]})"
        cls = ScheduleGPipe if schedule == "gpipe" else Schedule1F1B
        self.schedule = cls(self.stage, n_microbatches=args.microbatches, loss_fn=lm_loss)
        self.module = self.stage.submod
        self.optimizer = optimizer_factory(args)(self.module.parameters())
        self.rank = rank

    def step(self, ids, target) -> float:
        losses: list[torch.Tensor] = []
        if self.rank == 0:
            self.schedule.step(ids)
        else:
            self.schedule.step(target=target, losses=losses)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        # the mean loss lives on the last rank only; share it for the printout (outside the timing)
        return float(torch.stack(losses).detach().mean()) if losses else float("nan")


def _loss_everywhere(value: float, rank: int) -> float:
    """The last rank's loss on every rank (pippy only computes it there)."""
    t = torch.tensor([value if rank == RANKS - 1 else 0.0], dtype=torch.float64)
    dist.all_reduce(t)
    return float(t.item())


def timed_step(system, ids, target) -> tuple[float, float]:
    dist.barrier()
    start = time.perf_counter()
    loss = system.step(ids, target)
    dist.barrier()
    return time.perf_counter() - start, loss


def run_rank(rank: int, args) -> dict | None:
    """Every model's results (by model, then schedule) on rank 0; None on the others."""
    torch.set_num_threads(args.threads)
    results = {name: run_model(rank, model_args(args, name)) for name in args.models}
    return results if rank == 0 else None


def run_model(rank: int, args) -> dict:
    """One model's timed steps of both systems under each schedule, and stagewise's breakdown per rank."""
    cut = args.layers // 2
    batches = make_batches(args, args.warmup + args.steps)
    results = {}
    for schedule in args.schedules:
        systems = [Stagewise(args, schedule, cut, batches[0]), Pippy(args, schedule, cut, batches[0], rank)]
        times = {s.name: [] for s in systems}
        losses = {s.name: [] for s in systems}
        breakdowns = []  # stagewise's split of each timed step on this rank
        for i, (ids, target) in enumerate(batches):
            order = systems if i % 2 == 0 else systems[::-1]  # alternate who goes first
            for system in order:
                seconds, loss = timed_step(system, ids, target)
                if i >= args.warmup:
                    times[system.name].append(seconds)
                    if isinstance(system, Stagewise):
                        breakdowns.append(system.breakdown())
                losses[system.name].append(loss)
        losses[Pippy.name] = [_loss_everywhere(v, rank) for v in losses[Pippy.name]]
        results[schedule] = {
            s.name: {"times": times[s.name], "losses": losses[s.name], "how": s.how}
            for s in systems
        }
        results[schedule]["breakdown"] = _every_rank({k: statistics.median(b[k] for b in breakdowns) for k in BREAKDOWN})
        del systems
    return results


def _every_rank(value: dict) -> list[dict]:
    """`value` of every rank, in rank order (a collective: every rank calls it)."""
    gathered: list = [None] * RANKS
    dist.all_gather_object(gathered, value)
    return gathered


# ---- launching --------------------------------------------------------------------------------------
def launch(args, run: Callable, show: Callable) -> None:
    """Every rank runs `run(rank, args)` and rank 0 then `show(args, results)`: under torchrun this process is
    one rank, else RANKS ranks are spawned here (zero_bubble_vs_pippy.py launches the same way)."""
    args.load_before = os.getloadavg()[0]
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # under torchrun: this process is one rank
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
        _run_and_show(int(os.environ["RANK"]), args, run, show)
        return
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_spawned, args=(os.path.join(tmp, "store"), args, run, show), nprocs=RANKS, join=True,
                           start_method="spawn")


def _spawned(rank: int, store_path: str, args, run: Callable, show: Callable) -> None:
    store = dist.FileStore(store_path, RANKS)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=RANKS, timeout=datetime.timedelta(seconds=120))
    _run_and_show(rank, args, run, show)


def _run_and_show(rank: int, args, run: Callable, show: Callable) -> None:
    """This rank's part of the benchmark (rank 0 prints the table), then leave the process group."""
    try:
        results = run(rank, args)
        if rank == 0:
            show(args, results)
    finally:
        dist.destroy_process_group()


def report(args, results: dict) -> None:
    from rich.console import Console

    console = Console(width=140)
    console.print(f"[bold]command:[/bold] {command_line()}")
    for name, by_schedule in results.items():
        report_model(console, model_args(args, name), by_schedule)
    console.print("pippy = torch.distributed.pipelining. sw/pippy = pippy step time / stagewise step time, i.e. the "
                  "throughput ratio stagewise / pippy (> 1: stagewise is faster; issue 23's target >= 1.20). samples/s "
                  "from the median. 'best' is each system's fastest step, the least disturbed by other load.")
    console.print(f"1-min load average before the run {args.load_before:.2f}, at its end {os.getloadavg()[0]:.2f} "
                  f"({os.cpu_count()} cores; this benchmark alone adds about 2: more means other processes competed "
                  "for the CPU and the medians are noisy)")


def report_model(console, args, results: dict) -> None:
    """One model's table (per schedule: both systems' step times and losses) and stagewise's breakdown per rank."""
    from rich.table import Table

    params = sum(p.numel() for p in make_model(args).parameters())
    console.print(
        f"[bold]{args.model}[/bold]: {args.layers} blocks, d={args.dim}, {args.heads} heads, vocab {args.vocab}, "
        f"seq {args.seq}, untied head, {params / 1e6:.2f} M parameters; minibatch {args.batch} sequences in "
        f"{args.microbatches} microbatches; AdamW(lr={args.lr}); 2 ranks over gloo, {args.threads} intra-op "
        f"thread(s) each; cut before blocks.{args.layers // 2}; {args.warmup} warm-up + {args.steps} timed steps per system"
    )
    systems = ("stagewise", Pippy.name)
    for schedule, by_system in results.items():
        for name in systems:
            console.print(f"  {schedule:5s} {name}: {by_system[name]['how']}")
    table = Table(title=f"{args.model}: stagewise vs torch.distributed.pipelining (same model, split, schedule, optimizer)")
    for col in ("schedule", "system", "median step ms", "best ms", "samples/s", "sw/pippy median",
                "sw/pippy best", "first loss", "last loss"):
        table.add_column(col, justify="right" if col not in ("schedule", "system") else "left")
    for schedule, by_system in results.items():
        medians = {n: statistics.median(by_system[n]["times"]) for n in systems}
        bests = {n: min(by_system[n]["times"]) for n in systems}
        for name in systems:
            r, mine = by_system[name], name == "stagewise"
            table.add_row(
                schedule, name, f"{1e3 * medians[name]:.1f}", f"{1e3 * bests[name]:.1f}", f"{args.batch / medians[name]:.1f}",
                f"{medians[Pippy.name] / medians['stagewise']:.3f}x" if mine else "",
                f"{bests[Pippy.name] / bests['stagewise']:.3f}x" if mine else "",
                f"{r['losses'][0]:.6f}", f"{r['losses'][-1]:.6f}",
            )
        pairs = zip(by_system["stagewise"]["losses"], by_system[Pippy.name]["losses"], strict=True)
        table.add_row(schedule, "[dim]max |loss diff|, all steps[/dim]", "", "", "", "", "",
                      f"{max(abs(a - b) for a, b in pairs):.2e}", "", end_section=True)
    console.print(table)
    for schedule, by_system in results.items():
        for rank, b in enumerate(by_system["breakdown"]):
            console.print(
                f"  {schedule:5s} stagewise rank {rank}: step {1e3 * b['step_s']:.1f} ms = compute {1e3 * b['compute_s']:.1f}"
                f" + waiting {1e3 * b['waiting_s']:.1f} + dispatch {1e3 * b['dispatch_s']:.1f} + p2p on the compute "
                f"thread {1e3 * b['inline_s']:.1f} (+ idle); compute / step {b['compute_s'] / b['step_s']:.2f}")
        busiest = max(b["compute_s"] for b in by_system["breakdown"])
        console.print(f"  {schedule:5s} a bound for any runtime on this split (no step is shorter than the busiest "
                      f"rank's compute; the bubble ignored): pippy's median step / that compute = "
                      f"{statistics.median(by_system[Pippy.name]['times']) / busiest:.3f}x")


def main() -> None:
    launch(parse_args(), run_rank, report)


if __name__ == "__main__":
    main()
