"""Where a step's time went, measured (`pipe.time_breakdown()`, `pipe.stats`): a device whose stage
is heavy shows compute, the device that depends on it shows waiting, the parts of each device's
step add up to it, and swapping shows as swap time. (Under torch.distributed:
tests/test_distributed.py checks the same on every case of its matrix.)"""

import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import stagewise as sw
from stagewise.ir.instructions import Stream
from tests.harness.measured import assert_parts_add_up
from tests.models.mlp import mlp

X, Y = torch.randn(64, 16), torch.randint(0, 5, (64,))
X8, Y8 = torch.randn(8, 8), torch.randint(0, 5, (8,))  # tests/models/mlp.py's input


class Heavy(nn.Module):
    """A layer whose compute dwarfs the runtime's per-instruction cost: `rounds` wide products."""

    def __init__(self, dim: int = 16, wide: int = 512, rounds: int = 8):
        super().__init__()
        self.up, self.mix, self.down = nn.Linear(dim, wide), nn.Linear(wide, wide), nn.Linear(wide, dim)
        self.rounds = rounds

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(x)
        for _ in range(self.rounds):
            h = torch.tanh(self.mix(h))
        return self.down(h)


def compute_busy(pipe: sw.Pipeline, device: int) -> float:
    """The device's compute instructions' seconds from the timeline, waits inside them included."""
    return sum(end - start for d, stream, _, start, end in pipe._executor.state.step.timeline
               if d == device and stream is Stream.COMPUTE)


@pytest.fixture(scope="module")
def heavy_first():
    """Device 0 runs the heavy layer, device 1 a light head; clipping adds a grad-norm all-reduce."""
    torch.manual_seed(0)
    model = nn.Sequential(Heavy(), nn.ReLU(), nn.Linear(16, 5))
    pipe = sw.compile(model, 2, (X,), loss_fn=F.cross_entropy, example_target=Y, microbatches=4,
                      schedule="1f1b", split_points=["2"], clip_grad_norm=1.0, cost="analytic")
    pipe.step(X, target=Y)  # warm-up
    began = time.perf_counter()
    pipe.step(X, target=Y)
    return pipe, time.perf_counter() - began


def test_the_slow_stage_computes_and_the_other_waits(heavy_first):
    pipe, wall_s = heavy_first
    assert [type(stage).__name__ for stage in pipe.stages] == ["Stage0", "Stage1"]
    assert any(isinstance(m, nn.Linear) and m.out_features == 512 for m in pipe.stages[0].modules())
    heavy, light = pipe.time_breakdown()
    assert heavy.compute_s > heavy.waiting_s + heavy.dispatch_s, heavy
    assert light.waiting_s > light.compute_s, light
    for row in (heavy, light):
        assert_parts_add_up(row, wall_s)


def test_a_wait_inside_an_instruction_is_waiting_not_compute(heavy_first):
    """Device 1's grad-norm all-reduce (a compute instruction) waits inside for device 0's last,
    heavy backward: those seconds are the light device's waiting, not its compute."""
    pipe, _ = heavy_first
    heavy, light = pipe.time_breakdown()
    inside = compute_busy(pipe, 1) - light.compute_s  # the timeline's seconds include the waits inside
    assert inside > 0.05 * heavy.compute_s, (inside, heavy, light)  # the last backward: about 1/6 of it
    assert light.waiting_s >= inside


def test_stats_rows_carry_the_last_steps_times(heavy_first):
    pipe, _ = heavy_first
    for stats, row in zip(pipe.stats, pipe.time_breakdown(), strict=True):
        assert stats["peak_bytes"] > 0 and stats["device"] == row.device
        assert {name: stats[name] for name in row if name != "device"} == {n: v for n, v in row.items() if n != "device"}


def test_swapping_shows_as_swap_time():
    pipe = sw.compile(mlp(depth=4), 2, (X8,), loss_fn=F.cross_entropy, example_target=Y8, microbatches=2,
                      schedule="gpipe", swap="on", cost="analytic")
    began = time.perf_counter()
    pipe.step(X8, target=Y8)
    wall_s = time.perf_counter() - began
    rows = pipe.time_breakdown()
    assert sum(row.swap_s for row in rows) > 0 and sum(s["swap_in_bytes"] for s in pipe.stats) > 0
    for row in rows:
        assert_parts_add_up(row, wall_s)
