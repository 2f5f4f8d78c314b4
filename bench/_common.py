"""Helpers shared by the benchmarks in bench/: the command line, a machine check, test-zoo models.

Not a benchmark itself. The scripts import it as `_common` (bench/ is on sys.path when a script
in it runs).
"""

from __future__ import annotations

import os
import shlex
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
import torch.nn as nn

ROOT = Path(__file__).resolve().parents[1]


def command_line() -> str:
    """The exact command that produced the figures (run from the repository root)."""
    return shlex.join(["python", *sys.argv])


def pin_threads() -> None:
    """One intra-op thread in every thread of this process, not only the main one.

    torch.set_num_threads(1) in the main thread does not reach every thread created later: here a
    bare `a @ b` in a new Python thread still uses every core (MKL), which would make the machine
    check below and the benchmarks' own helper threads lie. (The runtime's stream threads measured
    1.0 CPU second per wall second either way.) OMP_NUM_THREADS / MKL_NUM_THREADS set before torch
    loads reach every thread, so the script re-executes itself once with both set to 1 (the printed
    command stays the same; --no-pin skips this).
    """
    if os.environ.get("OMP_NUM_THREADS") == "1" and os.environ.get("MKL_NUM_THREADS") == "1":
        torch.set_num_threads(1)
        return
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    os.execve(sys.executable, [sys.executable, *sys.argv], env)


def tests_models():
    """The test model zoo (tests/models), importable from a benchmark run from anywhere."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    import tests.models.gpt as gpt  # noqa: PLC0415 - needs the repository root on sys.path first

    return gpt


def matmul_rate(threads: int, seconds: float = 0.4, n: int = 384) -> float:
    """GFLOP/s of one thread when `threads` Python threads run fp32 matmuls at once (one intra-op
    thread each): how much concurrent devices of one process slow each other down here."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    counts = [0] * threads
    stop = time.perf_counter() + seconds

    def work(i: int) -> None:
        while time.perf_counter() < stop:
            a @ b
            counts[i] += 1

    workers = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
    start = time.perf_counter()
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    elapsed = time.perf_counter() - start
    return sum(counts) / threads * 2 * n**3 / elapsed / 1e9


def machine_note() -> str:
    """One line on the machine's state: cores, load, and the per-thread matmul rate alone and with
    1 and 3 more concurrent threads (a loaded or SMT-shared machine shows it here)."""
    torch.set_num_threads(1)
    alone, two, four = matmul_rate(1), matmul_rate(2), matmul_rate(4)
    load = os.getloadavg()
    return (f"machine: {os.cpu_count()} CPU cores, load average {load[0]:.2f} / {load[1]:.2f} / {load[2]:.2f} "
            f"(1 / 5 / 15 min); fp32 matmul per thread (1 intra-op thread): {alone:.0f} GFLOP/s alone, "
            f"{two:.0f} with 2 threads, {four:.0f} with 4 threads running at once; OMP_NUM_THREADS="
            f"{os.environ.get('OMP_NUM_THREADS', 'unset')}, MKL_NUM_THREADS={os.environ.get('MKL_NUM_THREADS', 'unset')}")


def start(args, width: int, fresh_cache: bool):
    """The shared preamble: one intra-op thread per device (pinned unless --no-pin), optionally a
    fresh profile cache (profiles measured in this run), and the command and machine printed."""
    from rich.console import Console  # noqa: PLC0415 - only benchmarks print tables

    if not args.no_pin:
        pin_threads()
    torch.set_num_threads(1)
    if fresh_cache:
        import tempfile  # noqa: PLC0415

        os.environ["STAGEWISE_CACHE"] = tempfile.mkdtemp(prefix="stagewise-bench-")
    console = Console(width=width)
    console.print(f"[bold]command:[/bold] {command_line()}")
    console.print(machine_note())
    return console


@dataclass
class Case:
    """One benchmark problem: a model, one minibatch and its loss."""

    key: str
    title: str
    model: nn.Module
    inputs: tuple
    target: torch.Tensor
    loss_fn: object


class Timed(Protocol):
    """A configuration a benchmark times: its step (returning the loss) and what each step took."""

    step: Callable[[], float]
    seconds: list[float]
    cpu_seconds: list[float]
    loss: float


def round_robin(configs: Sequence[Timed], warmup: int, steps: int) -> None:
    """Warm-up steps, then timed steps in round robin, so drift in the machine's speed affects every
    configuration alike; each keeps its step times (wall, and the process's CPU time: every thread)
    and its last loss."""
    for _ in range(warmup):
        for config in configs:
            config.step()
    for _ in range(steps):
        for config in configs:
            start, cpu = time.perf_counter(), time.process_time()
            config.loss = config.step()
            config.seconds.append(time.perf_counter() - start)
            config.cpu_seconds.append(time.process_time() - cpu)
