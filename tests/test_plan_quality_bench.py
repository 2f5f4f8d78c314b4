"""bench/plan_quality.py's measured busy time per device reads each step's own timeline: under the
prebound executor its wrapper around InstructionHandlers.dispatch saw nothing, so every measured
column read 0 ms ("74->0 | 95->0")."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import stagewise as sw
from tests.models.mlp import mlp

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import plan_quality as bench  # noqa: E402 - bench/ is on sys.path only from here


def test_each_device_s_compute_is_read_from_the_step():
    x, y = torch.randn(8, 8), torch.randint(0, 5, (8,))
    pipe = sw.compile(mlp(), 2, (x,), loss_fn=F.cross_entropy, example_target=y, microbatches=4, cost="analytic")
    start = time.perf_counter()
    pipe.step(x, target=y)
    wall = time.perf_counter() - start
    busy = bench.compute_busy(pipe)
    assert set(busy) == {0, 1} and all(0 < seconds <= wall for seconds in busy.values())
