"""What the test suite's garbage collector settings (tests/harness/collector.py) save: a TinyGPT
compiled and trained again and again, once with Python's default collector and once with the
suite's, each in a fresh process (a frozen collector cannot be unset), alternating.

    python bench/suite_collector.py                  # 6 compiles per run, 2 runs of each
    python bench/suite_collector.py --compiles 10 --runs 3

Per run: the process's CPU seconds for the loop, the CPU seconds the collector itself took (gc.callbacks)
and how many collections it made.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def loop(compiles: int, suite_collector: bool) -> dict:
    """Compile and train the 4-layer TinyGPT `compiles` times; what it cost and what the collector took."""
    import torch

    import stagewise as sw
    from tests.harness.collector import collect_less
    from tests.models.gpt import TinyGPT, lm_loss
    from tests.reference import ADAMW, pipeline_train, token_batches

    torch.set_num_threads(1)
    if suite_collector:
        collect_less()
    collecting = {"seconds": 0.0, "collections": 0, "since": 0.0}

    def timed(phase: str, _info: dict) -> None:
        if phase == "start":
            collecting["since"] = time.process_time()
        else:
            collecting["seconds"] += time.process_time() - collecting["since"]
            collecting["collections"] += 1

    gc.callbacks.append(timed)
    ids = torch.randint(0, 64, (8, 9))
    start = time.process_time()
    for _ in range(compiles):
        torch.manual_seed(0)
        pipe = sw.compile(TinyGPT(layers=4), 2, (ids[:, :-1],), loss_fn=lm_loss, example_target=ids[:, 1:],
                          optimizer=ADAMW, microbatches=4, cost="analytic")
        pipeline_train(pipe, token_batches())
    return {"cpu_s": time.process_time() - start, "gc_s": collecting["seconds"], "collections": collecting["collections"]}


def run(compiles: int, suite_collector: bool) -> dict:
    """`loop` in a fresh interpreter."""
    code = (f"import json, sys; sys.path.insert(0, {str(ROOT)!r}); from bench.suite_collector import loop; "
            f"print(json.dumps(loop({compiles}, {suite_collector})))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compiles", type=int, default=6)
    parser.add_argument("--runs", type=int, default=2)
    args = parser.parse_args()
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores; {args.compiles} compiles per run")
    print(f"{'collector':<24}{'CPU s':>8}{'collector CPU s':>17}{'collections':>13}")
    for _ in range(args.runs):
        for label, suite in (("Python's (700, 10, 10)", False), ("the suite's", True)):
            figures = run(args.compiles, suite)
            print(f"{label:<24}{figures['cpu_s']:>8.2f}{figures['gc_s']:>17.2f}{figures['collections']:>13}")
    print("command: python " + " ".join(sys.argv))


if __name__ == "__main__":
    main()
