"""stagewise vs torch.distributed.pipelining: the same model, split, schedule and training, 2 ranks over gloo.

    python bench/runtime_vs_pippy.py            # default run (about 1-2 minutes on 2 CPU cores)
    python bench/runtime_vs_pippy.py --quick    # smoke run (about 30 s)
    torchrun --standalone --nproc-per-node 2 bench/runtime_vs_pippy.py   # the same under torchrun

Both systems train one GPT-style model (untied LM head, so the graph has no tensor shared across
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
second) and the throughput ratio stagewise / pippy.

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

import _common
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F

RANKS = 2


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
    p.add_argument("--quick", action="store_true", help="smoke run: fewer steps, one schedule pass (~30 s)")
    p.add_argument("--schedules", default="gpipe,1f1b", help="comma-separated, from gpipe,1f1b")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--batch", type=int, default=16, help="sequences per minibatch")
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--steps", type=int, default=60, help="timed steps per system and schedule")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--threads", type=int, default=1, help="intra-op threads per rank")
    p.add_argument("--pippy-manual", action="store_true",
                   help="build pippy's stages by hand (PipelineStage) instead of tracing with pipeline()")
    args = p.parse_args(argv)
    if args.quick:
        args.steps, args.warmup = 6, 1
    args.schedules = [s.strip() for s in args.schedules.split(",") if s.strip()]
    for s in args.schedules:
        if s not in ("gpipe", "1f1b"):
            p.error(f"unknown schedule {s!r}")
    return args


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
    torch.set_num_threads(args.threads)
    cut = args.layers // 2
    batches = make_batches(args, args.warmup + args.steps)
    results = {}
    for schedule in args.schedules:
        systems = [Stagewise(args, schedule, cut, batches[0]), Pippy(args, schedule, cut, batches[0], rank)]
        times = {s.name: [] for s in systems}
        losses = {s.name: [] for s in systems}
        for i, (ids, target) in enumerate(batches):
            order = systems if i % 2 == 0 else systems[::-1]  # alternate who goes first
            for system in order:
                seconds, loss = timed_step(system, ids, target)
                if i >= args.warmup:
                    times[system.name].append(seconds)
                losses[system.name].append(loss)
        losses[Pippy.name] = [_loss_everywhere(v, rank) for v in losses[Pippy.name]]
        results[schedule] = {
            s.name: {"times": times[s.name], "losses": losses[s.name], "how": s.how}
            for s in systems
        }
        del systems
    return results if rank == 0 else None


# ---- launching --------------------------------------------------------------------------------------
def _spawned(rank: int, store_path: str, args) -> None:
    store = dist.FileStore(store_path, RANKS)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=RANKS, timeout=datetime.timedelta(seconds=120))
    _run_and_report(rank, args)


def _run_and_report(rank: int, args) -> None:
    """This rank's part of the benchmark (rank 0 prints the table), then leave the process group."""
    try:
        results = run_rank(rank, args)
        if rank == 0:
            report(args, results)
    finally:
        dist.destroy_process_group()


def report(args, results: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=140)
    console.print(f"[bold]command:[/bold] {command_line()}")
    params = sum(p.numel() for p in make_model(args).parameters())
    console.print(
        f"model: nn.Module, {args.layers} blocks, d={args.dim}, {args.heads} heads, vocab {args.vocab}, seq {args.seq}, "
        f"untied head, {params / 1e6:.2f} M parameters; minibatch {args.batch} sequences in {args.microbatches} "
        f"microbatches; AdamW(lr={args.lr}); 2 ranks over gloo, {args.threads} intra-op thread(s) each; "
        f"cut before blocks.{args.layers // 2}; {args.warmup} warm-up + {args.steps} timed steps per system"
    )
    for schedule, by_system in results.items():
        for name, r in by_system.items():
            console.print(f"  {schedule:5s} {name}: {r['how']}")
    table = Table(title="stagewise vs torch.distributed.pipelining (same model, split, schedule, optimizer)")
    for col in ("schedule", "system", "median step ms", "best ms", "samples/s", "sw/pippy median",
                "sw/pippy best", "first loss", "last loss"):
        table.add_column(col, justify="right" if col not in ("schedule", "system") else "left")
    for schedule, by_system in results.items():
        sw_r, pp_r = by_system["stagewise"], by_system[Pippy.name]
        medians = {n: statistics.median(r["times"]) for n, r in by_system.items()}
        bests = {n: min(r["times"]) for n, r in by_system.items()}
        for name, r in by_system.items():
            mine = name == "stagewise"
            table.add_row(
                schedule, name, f"{1e3 * medians[name]:.1f}", f"{1e3 * bests[name]:.1f}", f"{args.batch / medians[name]:.1f}",
                f"{medians[Pippy.name] / medians['stagewise']:.3f}x" if mine else "",
                f"{bests[Pippy.name] / bests['stagewise']:.3f}x" if mine else "",
                f"{r['losses'][0]:.6f}", f"{r['losses'][-1]:.6f}",
            )
        diff = max(abs(a - b) for a, b in zip(sw_r["losses"], pp_r["losses"], strict=True))
        table.add_row(schedule, "[dim]max |loss diff|, all steps[/dim]", "", "", "", "", "", f"{diff:.2e}", "",
                      end_section=True)
    console.print(table)
    console.print("pippy = torch.distributed.pipelining. sw/pippy = pippy step time / stagewise step time, i.e. the "
                  "throughput ratio stagewise / pippy (> 1: stagewise is faster; target >= 1.05). samples/s from the "
                  "median. 'best' is each system's fastest step, the least disturbed by other load.")
    console.print(f"1-min load average before the run {args.load_before:.2f}, at its end {os.getloadavg()[0]:.2f} "
                  f"({os.cpu_count()} cores; this benchmark alone adds about 2: more means other processes competed "
                  "for the CPU and the medians are noisy)")


def main() -> None:
    args = parse_args()
    args.load_before = os.getloadavg()[0]
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # under torchrun: this process is one rank
        rank = int(os.environ["RANK"])
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
        _run_and_report(rank, args)
        return
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_spawned, args=(os.path.join(tmp, "store"), args), nprocs=RANKS, join=True,
                           start_method="spawn")


if __name__ == "__main__":
    main()
