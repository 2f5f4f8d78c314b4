"""Virtual devices (VirtualFlow): one plan for V devices, bitwise the same on any physical count.

GPT-2 ties its embedding and head: split over stages, the tied weight's gradient is the all-reduce
of each stage's part, in the plan's order; on one device autograd sums the parts in another. So
plans made for 1 and for 4 devices train to different bits, while the plan for 4 virtual devices
trains to the same bits on 1, 2 or 4 physical devices, and across `pipe.resize` between steps.
"""

from __future__ import annotations

import pytest
import torch

import stagewise as sw
from stagewise.compiler.pipeline import virtual_devices
from stagewise.compiler.pipeline.virtual_devices import virtual_counts, virtual_layout
from stagewise.runtime.launch import DistributedContext
from tests.training_problems import (
    GROUPED,
    batches_of,
    compiled,
    state_of,
    step,
    train_scheduled,
    warmup_cosine,
)

STEPS = 3


def _run(devices: int, virtual: int | None, resize_to: list[int] = ()) -> tuple[list, dict]:
    """GPT-2 with dropout, groups, warmup-cosine, clipping; `resize_to`: physical counts after each step."""
    batches = batches_of("hf-gpt2", STEPS)
    pipe = compiled("hf-gpt2", batches, "1f1b", optimizer=GROUPED, clip_grad_norm=0.5, dropout=0.1,
                    devices=["cpu"] * devices, virtual_devices=virtual)
    sched = torch.optim.lr_scheduler.LambdaLR(pipe.optimizer, warmup_cosine)
    losses = []
    for index, batch in enumerate(batches):
        losses += train_scheduled(pipe, sched, [batch])
        if index < len(resize_to):
            pipe.resize(["cpu"] * resize_to[index])
    return losses, state_of(pipe)


@pytest.fixture(scope="module")
def four_virtual_on_four() -> tuple[list, dict]:
    return _run(4, 4)


def _bitwise(got: tuple[list, dict], want: tuple[list, dict]) -> None:
    assert [(float(loss), norm, lrs) for loss, norm, lrs in got[0]] == [
        (float(loss), norm, lrs) for loss, norm, lrs in want[0]]
    for key, tensor in want[1].items():
        assert torch.equal(got[1][key], tensor), key


def test_four_virtual_devices_on_one_then_two_physical_ones_train_bitwise_as_on_four(four_virtual_on_four):
    """Started on one physical device, resized to two after the first step and to four after the
    second: every step bitwise the uninterrupted run's on four."""
    _bitwise(_run(1, 4, resize_to=[2, 4]), four_virtual_on_four)


def test_without_virtual_devices_one_device_trains_to_other_bits(four_virtual_on_four):
    """What the virtual plan fixes: the plan made for one device sums the tied gradient its own way."""
    losses, state = _run(1, None)
    assert any(not torch.equal(state[k], four_virtual_on_four[1][k]) for k in state)


def test_a_resized_pipeline_saves_and_loads_onto_other_physical_devices(tmp_path, four_virtual_on_four):
    batches = batches_of("hf-gpt2", STEPS)
    pipe = compiled("hf-gpt2", batches[:1], "1f1b", optimizer=GROUPED, clip_grad_norm=0.5, dropout=0.1,
                    devices=["cpu"], virtual_devices=4)
    sched = torch.optim.lr_scheduler.LambdaLR(pipe.optimizer, warmup_cosine)
    train_scheduled(pipe, sched, batches[:2])
    pipe.save(tmp_path / "ck", scheduler=sched)
    loaded = sw.load(tmp_path / "ck", devices=["cpu", "cpu"])
    assert len(loaded.plan.devices) == 4
    resumed = torch.optim.lr_scheduler.LambdaLR(loaded.optimizer, warmup_cosine)
    loaded.load_scheduler(resumed)
    got = train_scheduled(loaded, resumed, batches[2:])
    assert [float(g[0]) for g in got] == [float(w[0]) for w in four_virtual_on_four[0][2:]]


def test_heterogeneous_devices_get_virtual_devices_in_proportion_to_speed():
    assert virtual_counts([1.0, 1.0], 4) == [2, 2]
    assert virtual_counts([3.0, 1.0], 4) == [3, 1]
    assert virtual_counts([1.0, 1.0, 1.0], 4) in ([2, 1, 1], [1, 2, 1], [1, 1, 2])
    assert virtual_counts([100.0, 1.0], 4) == [3, 1]  # every physical device runs at least one
    fast, slow = sw.Device("cpu", memory="4GiB", speed=3.0), sw.Device("cpu", memory="1GiB", speed=1.0)
    layout = virtual_layout([fast, slow], 4)
    assert [d.speed for d in layout] == [1.0, 1.0, 1.0, 1.0]  # balanced: each a share of its device
    assert [d.memory for d in layout] == [(4 << 30) // 3] * 3 + [1 << 30]


def test_bad_virtual_device_counts_are_named():
    with pytest.raises(sw.OptionError, match="virtual_devices=1 must be an int of at least the 2"):
        virtual_layout(["cpu", "cpu"], 1)
    with pytest.raises(sw.OptionError, match="virtual_devices=True"):
        virtual_layout(["cpu"], True)
    batches = batches_of("tied-gpt", 1)
    pipe = compiled("tied-gpt", batches, "1f1b", devices=2)
    with pytest.raises(sw.CapacityError, match="would run virtual devices"):
        pipe.resize([sw.Device("cpu", memory="1KiB")])
    step(pipe, batches[0])  # a refused resize leaves the pipeline as it was


def test_under_tensor_parallel_virtual_devices_count_pipeline_devices(monkeypatch):
    """With tensor_parallel=T, T ranks run each device of the plan (`RankLayout`): on 4 ranks at
    T = 2 the plan has 2 devices, so virtual_devices=2 is right and 4 (the world size) is not."""
    monkeypatch.setattr(virtual_devices, "distributed_context", lambda: DistributedContext(0, 4, 0))
    assert len(virtual_layout(["cpu"], 2, tensor_parallel=2)) == 2
    with pytest.raises(sw.OptionError, match="world size / 2"):
        virtual_layout(["cpu"], 4, tensor_parallel=2)
    assert len(virtual_layout(["cpu"], 4)) == 4  # T = 1: one process per device, as before
