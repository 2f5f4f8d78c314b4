"""What exporting without torch's fake-tensor dispatch cache saves (passes/capture_tracers.py
`_no_fake_tensor_cache`): the capture's export of the test zoo's models, and their whole compile, with
the cache (the baseline: torch's default) and without it (stagewise's), alternating in one process so
the machine's load weighs on both alike.

    python bench/export_cache.py              # 3 rounds
    python bench/export_cache.py --rounds 5

Per model: the process's CPU seconds for the symbolic export (`trace_export(dynamic=True)`, as
`compile` asks for it) and for a whole `compile` (analytic costs, as tests/reference.py plans), the
median over the rounds, and whether the two exports give the same graph but for its nodes' numbering.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import stagewise as sw  # noqa: E402 - after the path that finds tests/
from stagewise.compiler.assembly.batches import first_microbatch, split_batch  # noqa: E402
from stagewise.passes import capture_tracers  # noqa: E402
from stagewise.passes.capture import Objective  # noqa: E402
from tests.hf import bert, gpt2, llama, lm_batches  # noqa: E402
from tests.models.gpt import TinyGPT, lm_loss  # noqa: E402
from tests.reference import ADAMW, token_batches  # noqa: E402

WAYS = ("cache", "no cache")


@contextlib.contextmanager
def exporting(way: str) -> Iterator[None]:
    """torch's default (the cache on) for the baseline, stagewise's own export otherwise."""
    if way == "cache":
        with mock.patch.object(capture_tracers, "_no_fake_tensor_cache", contextlib.nullcontext):
            yield
    else:
        yield


def problems() -> dict[str, tuple[torch.nn.Module, object, torch.Tensor | None, Callable | None]]:
    """(model, one microbatch of inputs, its target, loss_fn) of the suite's usual models."""
    ids, _ = lm_batches(1)[0]
    tokens, target = token_batches(1)[0]
    return {"TinyGPT(layers=4)": (TinyGPT(), tokens, target, lm_loss),
            "HF GPT-2": (gpt2(), ids, None, None), "HF Llama": (llama(), ids, None, None),
            "HF BERT": (bert(), ids, None, None)}


def export_seconds(model, inputs, target, loss_fn) -> tuple[float, str]:
    """CPU seconds of the capture's symbolic export at a microbatch of 2 of 4, and its graph's code."""
    inputs, target = split_batch(inputs, 4)[0], first_microbatch(target, 4)
    objective = Objective(model, loss_fn, isinstance(inputs, dict))
    start = time.process_time()
    graph, _ = capture_tracers.trace_export(objective, inputs, target, len(inputs), dynamic=True)
    return time.process_time() - start, re.sub(r"_\d+\b", "_N", graph.code)


def compile_seconds(model, inputs, target, loss_fn) -> float:
    start = time.process_time()
    sw.compile(model, 2, inputs, loss_fn=loss_fn, example_target=target, optimizer=ADAMW, microbatches=4,
               cost="analytic")
    return time.process_time() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)  # as the suite (tests/conftest.py)
    torch.manual_seed(0)
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores; {args.rounds} rounds, median CPU s")
    print(f"{'model':<20}{'export cache':>14}{'no cache':>10}{'compile cache':>15}{'no cache':>10}{'same graph':>12}")
    for name, problem in problems().items():
        for way in WAYS:  # warm-up: imports, first-call costs
            with exporting(way):
                compile_seconds(*problem)
        exports: dict[str, list[float]] = {way: [] for way in WAYS}
        compiles: dict[str, list[float]] = {way: [] for way in WAYS}
        graphs: dict[str, str] = {}
        for _ in range(args.rounds):
            for way in WAYS:
                with exporting(way):
                    seconds, graphs[way] = export_seconds(*problem)
                    exports[way].append(seconds)
                    compiles[way].append(compile_seconds(*problem))
        figures = [statistics.median(runs[way]) for runs in (exports, compiles) for way in WAYS]
        print(f"{name:<20}" + "".join(f"{f:>{w}.2f}" for f, w in zip(figures, (14, 10, 15, 10), strict=True))
              + f"{str(graphs['cache'] == graphs['no cache']):>12}")
    print(f"load average {os.getloadavg()[0]:.1f} at the end")
    print("command: python " + " ".join(sys.argv))


if __name__ == "__main__":
    main()
