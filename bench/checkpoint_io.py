"""Checkpoint I/O on 2 gloo ranks: stagewise's per-rank parallel save against gathering to rank 0.

    python bench/checkpoint_io.py            # default run (about 1-2 minutes on 2 CPU cores)
    python bench/checkpoint_io.py --quick    # smoke run (a smaller model, 1 repeat)

The big_model bench's model (bench/big_model.py: the test zoo's GPT with an untied head, built by
its `make_model`, same defaults: 12 blocks, d=384, vocab 512) is compiled by both of 2 gloo ranks
(spawned processes joined through a file store, one intra-op thread each) cut in the middle
(`split_points=["blocks.<layers / 2>"]`, 1F1B, analytic costs so that both ranks plan alike), one
stage per rank, and trained one step with AdamW, so a checkpoint holds the weights and AdamW's two
tensors per parameter. Then on that pipeline, in one run, the two methods alternate, each
`--repeats` times (the best is kept: this machine is shared and noisy):

- stagewise, `pipe.save(dir)`: every rank writes its own stage's tensors into one
  torch.distributed.checkpoint (DCP) folder in parallel (`weights/__<rank>_0.distcp`); rank 0 also
  writes the small files (DCP's `.metadata`, plan, stage code, training state, and the marker with
  every file's SHA-256, which rank 0 computes over every shard) and renames the folder into place.
  Loads: `pipe.restore(dir)` into the running pipeline (each rank reads the names its stage holds:
  the code path of restoring into any plan) and `sw.load(dir)` (a second pipeline rebuilt from the
  checkpoint alone).
- gather to rank 0 (the design before): each rank takes its stages' state (`w.state_tensors()`
  and `w.optimizer_state()` for `w in pipe._workers`), `dist.gather_object` to rank 0, which
  `torch.save`s one file (beside, fsync'd, renamed: DCP's writer syncs its files too) while the
  other rank waits at a barrier, so that with both methods save returns once the checkpoint is in
  place. Load: rank 0 `torch.load(weights_only=True)`s the file, `dist.scatter_object_list` hands
  each rank its part, and each copies it into its stage (weights, `load_optimizer_state`).

Per rank: seconds from a barrier until the call returns on that rank, the bytes it wrote (its DCP
shard, and rank 0's small files; the gathered file), and the call's peak extra resident memory
(VmHWM after it, reset through /proc/self/clear_refs before it, minus VmRSS before it). Then in
this parent process, on the same checkpoints: `pipe.restore` into the model compiled on 1 device
(job morphing, 2 ranks to 1 process), `sw.load` (every stage in one process) and `torch.load` of
the gathered file.

The checkpoints go to a temporary folder on the local disk (removed at the end; `--dir` to choose),
and every load reads what the save before it wrote, from the page cache (dropping it needs root).
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import datetime
import functools
import gc
import os
import pickle
import re
import shutil
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import _common
import big_model
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import stagewise as sw

RANKS = 2
LIMIT_S = 900.0  # the ranks are killed past this (never a hung benchmark)
SW_DIR, GATHERED = "stagewise-ckpt", "gathered.pt"
_LIBC = ctypes.CDLL(ctypes.util.find_library("c"))


# ---- options ------------------------------------------------------------------------------------
def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="smoke run: 4 blocks of d=256, 1 repeat")
    big_model.add_model_arguments(p, microbatches=4)
    p.add_argument("--repeats", type=int, default=3, help="measurements of each operation (the best is shown)")
    p.add_argument("--dir", default=None, help="where the checkpoints go (default: a temporary folder, removed)")
    args = p.parse_args(argv)
    if args.quick:
        args.layers, args.dim, args.heads, args.repeats = 4, 256, 4, 1
    return args


def compile_pipe(args, devices: int):
    """The big_model bench's model and batches, compiled on `devices` (the ranks' when under a process group)."""
    model = big_model.make_model(args)
    batches = big_model.make_batches(args, 1)
    ids, target = batches[0]
    split = {"split_points": [f"blocks.{args.layers // 2}"]} if devices > 1 else {"stages": 1}
    pipe = sw.compile(model, devices, (ids,), loss_fn=big_model.lm_loss, example_target=target,
                      schedule="1f1b", cost="analytic", microbatches=args.microbatches,
                      optimizer=big_model.optimizer(args), **split)
    return pipe, batches


# ---- measuring one call -------------------------------------------------------------------------
def _status_kib(field: str) -> int:
    return int(re.search(rf"^{field}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.M).group(1))


def measured(fn) -> tuple[float, int]:
    """(seconds, peak extra resident bytes) of `fn()`. Freed heap memory is given back first (glibc's
    malloc_trim), so that what the call allocates shows instead of reusing what an earlier one freed."""
    gc.collect()
    _LIBC.malloc_trim(0)
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    before = _status_kib("VmRSS")
    start = time.perf_counter()
    fn()
    seconds = time.perf_counter() - start
    return seconds, (_status_kib("VmHWM") - before) * 1024


# ---- the two methods on one rank ------------------------------------------------------------------
def sw_save(pipe, root: Path, rank: int) -> None:
    pipe.save(root / SW_DIR)


def sw_restore(pipe, root: Path, rank: int) -> None:
    pipe.restore(root / SW_DIR, report=False)


def sw_load(pipe, root: Path, rank: int) -> None:
    loaded = sw.load(root / SW_DIR)
    del loaded


def gather_save(pipe, root: Path, rank: int) -> None:
    """Every stage's state gathered to rank 0, which writes one file; returns once it is in place."""
    pipe._executor.settle()
    part = {w.stage.index: {"weights": w.state_tensors(), "optimizer": w.optimizer_state()} for w in pipe._workers}
    parts: list | None = [None] * RANKS if rank == 0 else None
    dist.gather_object(part, parts, dst=0)
    del part
    if rank == 0:
        path = root / GATHERED
        partial = path.with_suffix(".partial")
        with open(partial, "wb") as f:
            torch.save({"ranks": parts}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(partial, path)
    del parts
    dist.barrier()


def gather_load(pipe, root: Path, rank: int) -> None:
    """Rank 0 reads the file and hands every rank its part; each copies it into its stages."""
    parts = torch.load(root / GATHERED, weights_only=True)["ranks"] if rank == 0 else None
    mine: list = [None]
    dist.scatter_object_list(mine, parts, src=0)
    del parts
    with torch.no_grad():
        for worker in pipe._workers:
            saved = mine[0][worker.stage.index]
            for name, tensor in worker.state_tensors().items():
                tensor.copy_(saved["weights"][name])
            worker.load_optimizer_state(saved["optimizer"])


# (method, operation, function): the order of one repeat; the methods alternate.
OPERATIONS = (
    ("stagewise", "save", sw_save), ("gather", "save", gather_save),
    ("stagewise", "restore", sw_restore), ("gather", "load", gather_load),
    ("stagewise", "sw.load", sw_load),
)


def written(root: Path, rank: int) -> dict[str, int]:
    """Bytes this rank wrote in each method's checkpoint (after the last save)."""
    folder = root / SW_DIR
    shard = folder / "weights" / f"__{rank}_0.distcp"
    small = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file() and p.suffix != ".distcp")
    return {"stagewise": shard.stat().st_size if shard.exists() else 0, "small": small if rank == 0 else 0,
            "gather": (root / GATHERED).stat().st_size if rank == 0 else 0}


def run_rank(rank: int, init_file: str, out: str, args) -> None:
    """One rank: compile, one step, then every operation `args.repeats` times; results to out/rank<r>.pkl."""
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=RANKS,
                            timeout=datetime.timedelta(seconds=300))
    torch.set_num_threads(1)
    root = Path(out)
    pipe, batches = compile_pipe(args, RANKS)
    pipe.timeout_s = 300.0
    ids, target = batches[0]
    loss = float(pipe.step(ids, target=target))
    runs: dict[tuple[str, str], list[tuple[float, int]]] = {}
    for _ in range(args.repeats):
        for method, operation, fn in OPERATIONS:
            dist.barrier()
            runs.setdefault((method, operation), []).append(measured(functools.partial(fn, pipe, root, rank)))
    dist.barrier()
    result = {"runs": runs, "written": written(root, rank), "loss": loss,
              "stages": sorted(w.stage.index for w in pipe._workers),
              "gather_part": len(pickle.dumps({w.stage.index: {"weights": w.state_tensors(),
                                                                "optimizer": w.optimizer_state()}
                                               for w in pipe._workers}))}
    (root / f"rank{rank}.pkl").write_bytes(pickle.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


def spawn(args, root: Path) -> list[dict]:
    """Both ranks, spawned; what each saved."""
    os.environ.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")  # every thread of a rank, not only its main one
    context = mp.start_processes(run_rank, args=(str(root / "store"), str(root), args), nprocs=RANKS,
                                 join=False, start_method="spawn")
    deadline = time.monotonic() + LIMIT_S
    while not context.join(timeout=0.5):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            raise SystemExit(f"the ranks did not finish within {LIMIT_S:.0f} s")
    return [pickle.loads((root / f"rank{r}.pkl").read_bytes()) for r in range(RANKS)]


# ---- the 2-rank checkpoints in one process ----------------------------------------------------------
def one_process(args, root: Path) -> dict[str, list[tuple[float, int]]]:
    """Each checkpoint read back in this process (1 intra-op thread): restore into the model compiled
    on 1 device, sw.load, torch.load of the gathered file; and going on on 1 device both ways: the
    model compiled again and restored into, or the checkpoint's graph planned again without it."""
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # DCP in one process says so
    pipe, _ = compile_pipe(args, 1)
    operations = {
        "stagewise: pipe.restore into 1 device": lambda: pipe.restore(root / SW_DIR, report=False),
        "stagewise: sw.load (both stages)": lambda: sw.load(root / SW_DIR),
        "gather: torch.load of the file": lambda: torch.load(root / GATHERED, weights_only=True),
        "stagewise: compile the model for 1 device + pipe.restore":
            lambda: compile_pipe(args, 1)[0].restore(root / SW_DIR, report=False),
        "stagewise: sw.load(devices=1), its graph planned again without the model":
            lambda: sw.load(root / SW_DIR, devices=1, report=False),
    }
    runs: dict[str, list[tuple[float, int]]] = {}
    for _ in range(args.repeats):
        for name, fn in operations.items():
            runs.setdefault(name, []).append(measured(fn))
    return runs


# ---- the report ------------------------------------------------------------------------------------
def best(runs: list[tuple[float, int]]) -> tuple[float, int]:
    """The fastest run's seconds, and the largest peak extra memory of any run."""
    return min(s for s, _ in runs), max(m for _, m in runs)


def seconds_cell(runs: list[tuple[float, int]]) -> str:
    times = sorted(s for s, _ in runs)
    spread = f" ({', '.join(f'{s:.2f}' for s in times[1:])})" if len(times) > 1 else ""
    return f"{times[0]:.2f}{spread}"


def _written_cell(written: dict[str, int], method: str) -> str:
    if method == "stagewise" and written["small"]:
        return f"{big_model.fmt(written['stagewise'])} + {big_model.fmt(written['small'])}"
    return big_model.fmt(written[method])


def report(console, args, ranks: list[dict], single: dict, model_note: str) -> None:
    from rich.table import Table  # noqa: PLC0415 - only the parent prints

    table = Table(title=f"checkpoint save and load on {RANKS} gloo ranks, best of {args.repeats} "
                        "(the other runs in brackets); peak extra RSS: the largest of the runs; bytes: rank 0's shard + small files")
    for col in ("method", "rank (stages)", "save s", "bytes written", "peak extra RSS save",
                "load s", "peak extra RSS load", "sw.load s", "peak extra RSS sw.load"):
        table.add_column(col, justify="left" if col == "method" else "right")
    loads = {"stagewise": "restore", "gather": "load"}
    for method, label in (("stagewise", "stagewise, per-rank DCP"), ("gather", "gather to rank 0")):
        for rank, result in enumerate(ranks):
            runs = result["runs"]
            rebuild = runs.get((method, "sw.load"))
            table.add_row(
                label, f"{rank} ({', '.join(map(str, result['stages']))})", seconds_cell(runs[(method, "save")]),
                _written_cell(result["written"], method), big_model.fmt(best(runs[(method, "save")])[1]),
                seconds_cell(runs[(method, loads[method])]), big_model.fmt(best(runs[(method, loads[method])])[1]),
                seconds_cell(rebuild) if rebuild else "", big_model.fmt(best(rebuild)[1]) if rebuild else "",
            )
    console.print(table)
    slowest = {key: max(best(r["runs"][key])[0] for r in ranks)
               for key in (("stagewise", "save"), ("gather", "save"), ("stagewise", "restore"), ("gather", "load"))}
    console.print(
        f"slowest rank, best run: save stagewise {slowest[('stagewise', 'save')]:.2f} s vs gather "
        f"{slowest[('gather', 'save')]:.2f} s ({slowest[('gather', 'save')] / slowest[('stagewise', 'save')]:.2f}x); "
        f"load (restore) stagewise {slowest[('stagewise', 'restore')]:.2f} s vs gather "
        f"{slowest[('gather', 'load')]:.2f} s ({slowest[('gather', 'load')] / slowest[('stagewise', 'restore')]:.2f}x)"
    )
    console.print(
        "bytes written: stagewise "
        + " + ".join(f"rank {r} {big_model.fmt(x['written']['stagewise'] + x['written']['small'])}"
                     for r, x in enumerate(ranks))
        + f"; gather: rank 0 {big_model.fmt(ranks[0]['written']['gather'])}; pickled state each rank sends to "
        "rank 0 under gather: " + ", ".join(f"rank {r} {big_model.fmt(x['gather_part'])}" for r, x in enumerate(ranks))
    )
    for name, runs in single.items():
        console.print(f"one process, the 2-rank checkpoint: {name}: {seconds_cell(runs)} s, "
                      f"peak extra RSS {big_model.fmt(best(runs)[1])}")
    console.print(model_note)


def main() -> None:
    from rich.console import Console  # noqa: PLC0415 - only the parent prints

    args = parse_args()
    console = Console(width=200)
    console.print(f"[bold]command:[/bold] {_common.command_line()}")
    model = big_model.make_model(args)
    params = sum(p.numel() for p in model.parameters())
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    del model
    console.print(
        f"model: bench/big_model.py's GPT, {args.layers} blocks, d={args.dim}, {args.heads} heads, vocab {args.vocab}, "
        f"untied head, {params / 1e6:.1f} M fp32 parameters ({big_model.fmt(weights)}); AdamW, so a checkpoint holds "
        f"about {big_model.fmt(3 * weights)} of tensors; split at blocks.{args.layers // 2} over {RANKS} gloo ranks, "
        f"1 intra-op thread each; {os.cpu_count()} CPU cores, load average {os.getloadavg()[0]:.2f}"
    )
    root = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="stagewise-checkpoint-io-"))
    root.mkdir(parents=True, exist_ok=True)
    try:
        start = time.perf_counter()
        ranks = spawn(args, root)
        console.print(f"ranks done in {time.perf_counter() - start:.0f} s (loss after one step "
                      f"{ranks[0]['loss']:.4f}); reading the checkpoints back in one process")
        single = one_process(args, root)
        report(console, args, ranks, single, _notes(ranks))
    finally:
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)


def _notes(ranks: list[dict]) -> str:
    spread = statistics.median(s for r in ranks for s, _ in r["runs"][("stagewise", "save")])
    return (
        f"(median stagewise save over every rank and run: {spread:.2f} s.) Seconds: from a barrier to the call's return "
        "on that rank; under both methods save returns once the checkpoint is in place, so the ranks' save times "
        "are alike. stagewise's save also hashes every file for the marker (rank 0, after the shards are written) "
        "and swaps the folder in; its loads check every shard's SHA-256 before reading (under torch.distributed "
        "each rank a share). Loads read from the page cache. 'load s' of stagewise: pipe.restore into the running "
        "pipeline; sw.load builds a second pipeline from the checkpoint."
    )


if __name__ == "__main__":
    main()
