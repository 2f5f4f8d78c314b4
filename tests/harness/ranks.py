"""Spawned gloo ranks: each joins a process group through a file store (as torchrun's processes do)
and saves what it ran; the parent reads the saves, killing the ranks past a limit (never a hung suite).

Starting a rank costs seconds, so one set of ranks runs a whole matrix of cases (`run_cases`),
and each case is then checked as its own test (`case_results`). The ranks are forked from a
forkserver that imported torch, stagewise and the test helpers once per test worker (`PRELOAD`):
a freshly spawned interpreter spent about 4 CPU-seconds importing them, for every rank. A rank
sees the environment variables the forkserver started with, not a test's monkeypatched
ones: pass what a rank needs as an argument."""

from __future__ import annotations

import datetime
import multiprocessing
import os
import pickle
import time
import traceback
from collections.abc import Callable, Hashable, Iterable
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.harness.collector import collect_less

RANKS = 2
SPAWN_LIMIT_S = 60.0  # a child that outlives this is killed and the test fails
# What every rank imports, and what its first compile imports (torch.export and dynamo, networkx):
# imported once in the forkserver, shared by every rank forked from it. Imports only: nothing here
# starts a thread or a process group, which a fork could not carry over.
PRELOAD = ("stagewise", "torch.distributed", "torch.export", "torch._dynamo", "networkx", "tests.harness.ranks",
           "tests.harness.rank_problems", "tests.reference", "tests.hf", "tests.training_problems")


def join(init_file: str, rank: int, timeout_s: float, ranks: int = RANKS) -> None:
    """Join the process group, with the suite's garbage collector settings (the forkserver has Python's)."""
    collect_less()
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=ranks,
                            timeout=datetime.timedelta(seconds=timeout_s))


def save_result(path: Path, result: object) -> None:
    """Written beside and renamed into place: a rank killed mid-write leaves its previous save."""
    partial = path.with_suffix(".partial")
    partial.write_bytes(pickle.dumps(result))
    partial.replace(path)


def run_cases(rank: int, init_file: str, out: str, cases: Iterable[Hashable],
              run_case: Callable[[Hashable], dict], ranks: int = RANKS) -> None:
    """On one rank of `ranks`: join, then `run_case(case)` for every case in turn, saving the results
    after each; the first failure (saved as its traceback) ends the matrix on this rank (the peer then
    fails on a PeerError: later collectives could not be matched)."""
    join(init_file, rank, 30.0, ranks)
    torch.set_num_threads(1)  # two ranks share the machine's cores
    path = Path(out) / f"rank{rank}.pkl"
    results: dict = {}
    for case in cases:
        try:
            results[case] = run_case(case)
        except Exception:  # noqa: BLE001 - the parent shows it
            results[case] = {"error": traceback.format_exc()}
            save_result(path, results)
            os._exit(0)  # the process group may be mid-collective; do not wait on it at exit
        save_result(path, results)
    dist.destroy_process_group()


def case_results(per_rank: list[dict], case: Hashable, limit_s: float) -> list[dict]:
    """Every rank's result of `case` from `run_cases`, each rank's own failure shown."""
    results = [results.get(case) for results in per_rank]
    for rank, result in enumerate(results):
        failed = [f"{c}: {r['error']}" for c, r in per_rank[rank].items() if "error" in r]
        assert result is not None, f"rank {rank} did not finish {case}; " + (
            "\n".join(failed) or f"it hung, or the matrix took over {limit_s:.0f} s")
        assert "error" not in result, f"rank {rank} failed:\n{result['error']}"
    return results


def spawn(fn: Callable[..., None], tmp_path: Path, *args: object, limit_s: float = SPAWN_LIMIT_S, fail_on_hang: bool = True,
          ranks: int = RANKS) -> list[dict | None]:
    """Run `fn(rank, init_file, out, *args)` on `ranks` processes; kill them past `limit_s` (and fail,
    unless the caller reads what they saved before that); what each saved in out/rank<r>.pkl."""
    init_file = str(tmp_path / "store")
    multiprocessing.get_context("forkserver").set_forkserver_preload(list(PRELOAD))  # read when it starts
    context = mp.start_processes(fn, args=(init_file, str(tmp_path), *args), nprocs=ranks, join=False,
                                 start_method="forkserver")
    deadline = time.monotonic() + limit_s
    while not context.join(timeout=0.5):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            if fail_on_hang:
                pytest.fail(f"the ranks did not finish within {limit_s:.0f} s (a hang)")
            break
    return [pickle.loads(p.read_bytes()) if p.exists() else None
            for p in (tmp_path / f"rank{r}.pkl" for r in range(ranks))]
