"""What planning the suite's equality checks with analytic costs saves (tests/reference.py
check_equal_training): the same compiles with cost="profile" (the default) and cost="analytic",
alternating in one process, so the machine's load weighs on both alike.

    python bench/suite_costs.py              # 3 rounds
    python bench/suite_costs.py --rounds 5

Per model: the process's CPU seconds per compile under each cost model, the median over the rounds.
Profiles come from this machine's cache (~/.cache/stagewise, as in the suite), so the profiled figure
is what a suite run pays once its cache is warm; a cold cache pays more.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import stagewise as sw  # noqa: E402 - after the path that finds tests/
from tests.hf import gpt2, lm_batches  # noqa: E402
from tests.models.gpt import TinyGPT, lm_loss  # noqa: E402
from tests.reference import ADAMW, token_batches  # noqa: E402

COSTS = ("profile", "analytic")


def tiny_gpt(cost: str) -> None:
    """test_swap's matrix: the 4-layer TinyGPT, harmony-pp swapping on 2 devices."""
    inputs, target = token_batches(1)[0]
    sw.compile(TinyGPT(layers=4), 2, inputs, loss_fn=lm_loss, example_target=target, optimizer=ADAMW,
               microbatches=4, schedule="harmony-pp", swap="on", cost=cost)


def hf_gpt2(cost: str) -> None:
    """test_huggingface's: GPT-2 (4 layers) returning its own loss, 1F1B on 3 devices."""
    inputs, _ = lm_batches(1)[0]
    sw.compile(gpt2(), 3, inputs, optimizer=ADAMW, microbatches=2, schedule="1f1b", cost=cost)


MODELS: dict[str, Callable[[str], None]] = {"TinyGPT(layers=4)": tiny_gpt, "HF GPT-2": hf_gpt2}


def cpu_seconds(compile_once: Callable[[str], None], cost: str) -> float:
    torch.manual_seed(0)
    start = time.process_time()
    compile_once(cost)
    return time.process_time() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)  # as the suite (tests/conftest.py)
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores; {args.rounds} rounds, median")
    print(f"{'model':<20}{'profile CPU s':>15}{'analytic CPU s':>16}{'saved':>8}")
    for name, compile_once in MODELS.items():
        for cost in COSTS:
            compile_once(cost)  # warm-up: imports, caches, the profile cache
        seconds: dict[str, list[float]] = {cost: [] for cost in COSTS}
        for _ in range(args.rounds):
            for cost in COSTS:
                seconds[cost].append(cpu_seconds(compile_once, cost))
        profile, analytic = (statistics.median(seconds[cost]) for cost in COSTS)
        print(f"{name:<20}{profile:>15.2f}{analytic:>16.2f}{1 - analytic / profile:>8.0%}")
    print("command: python " + " ".join(sys.argv))


if __name__ == "__main__":
    main()
