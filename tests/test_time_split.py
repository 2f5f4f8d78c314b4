"""Where the predicted time goes (passes/sim_split.py, ir/time_split.py): worked by hand on hand-made
programs with known charges, then on plans: one that swaps is PCIe-bound, and the split a plan keeps
prints the same after plan.json is written and read (an old plan.json without it still loads)."""

from __future__ import annotations

import functools
import json

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

import stagewise as sw
from stagewise.ir.errors import CheckpointError
from stagewise.ir.instructions import AllReduceShared, Backward, Forward, State, SwapIn, SwapOut
from stagewise.ir.program import Program
from stagewise.ir.time_split import Bound, TimeSplit
from stagewise.passes.lower import lower
from stagewise.passes.schedule import schedule_tasks
from stagewise.passes.sim_split import device_splits, time_split
from stagewise.passes.simulate import SimCost, simulate
from tests.harness.stages import chain


def _pipeline(schedule: str, p: int, m: int) -> tuple[Program, ...]:
    stages, transfers = chain(p)
    return lower(stages, transfers, (), schedule_tasks(schedule, p, m)[1], clip_grad_norm=False)


def _assert_split(split: TimeSplit, expected: TimeSplit) -> None:
    """`split` is `expected`, its seconds to rounding (pytest.approx compares a dataclass exactly)."""
    assert (split.device, split.bound) == (expected.device, expected.bound)
    assert [s for _, s in split.parts()] == pytest.approx([s for _, s in expected.parts()], rel=1e-12, abs=1e-12)


def _sums_to_the_iteration(result) -> None:
    for split in device_splits(result).values():
        assert split.iteration_s == pytest.approx(result.iteration_time, rel=1e-12)


@pytest.mark.parametrize("p, m", [(2, 1), (4, 8)])
def test_free_links_leave_compute_and_the_bubble(p: int, m: int) -> None:
    """GPipe on equal stages with free messages: each device computes m (tf + tb) and waits the
    (p - 1)(tf + tb) of the pipeline's fill and drain; compute-bound, dev0 on the tie."""
    result = simulate(_pipeline("gpipe", p, m), SimCost.uniform(p, 1.0, 2.0))
    for device, split in device_splits(result).items():
        _assert_split(split, TimeSplit(device, m * 3.0, (p - 1) * 3.0, 0.0, 0.0, 0.0, Bound.COMPUTE))
    assert time_split(result).device == 0
    _sums_to_the_iteration(result)


def test_slow_messages_worked_by_hand_bound_the_network() -> None:
    """Two stages, one microbatch, 400 bytes at 100 B/s plus 0.5 s latency: each hop 4.5 s. dev0 runs F
    [0, 1], sends [1, 5.5], waits, receives the gradient [8.5, 13], runs B [13, 15]: compute 3, p2p 9,
    bubble 3 of 15; dev1 the mirror image."""
    cost = SimCost.uniform(2, 1.0, 2.0, value_bytes={"h0": 400.0}, bandwidth=100.0, latency_s=0.5)
    result = simulate(_pipeline("gpipe", 2, 1), cost)
    assert result.iteration_time == pytest.approx(15.0)
    splits = device_splits(result)
    for device in (0, 1):
        _assert_split(splits[device], TimeSplit(device, 3.0, 3.0, 0.0, 9.0, 0.0, Bound.NETWORK))
    assert time_split(result) == splits[0]
    assert str(splits[0]) == "compute 20% · bubble 20% · p2p 60% — bound: network"
    _sums_to_the_iteration(result)


def test_a_swap_waited_for_is_exposed_and_one_under_compute_is_hidden() -> None:
    """One device, host link 100 B/s: the weights' swap-in [0, 8] before F [8, 9] and B [9, 11], their
    swap-out [11, 19] after; the optimizer state's swap-in [8, 10] runs under compute and counts
    nowhere. Swap 16 of 19: PCIe-bound."""
    program = Program(0, (SwapIn(0, State.WEIGHTS, 800), SwapIn(0, State.OPTIMIZER, 200),
                          Forward(0, 0, waits=(0,)), Backward(0, 0), SwapOut(0, State.WEIGHTS, 800, waits=(3,))))
    result = simulate((program,), SimCost((1.0,), (2.0,), host_bandwidth=100.0))
    assert result.iteration_time == pytest.approx(19.0)
    _assert_split(time_split(result), TimeSplit(0, 3.0, 0.0, 16.0, 0.0, 0.0, Bound.PCIE))
    assert str(time_split(result)) == "compute 16% · swap 84% — bound: PCIe"
    _sums_to_the_iteration(result)


def test_an_all_reduce_counts_from_when_every_member_joined() -> None:
    """dev0 computes 1 s, dev1 3 s, then both all-reduce 200 bytes at 100 B/s (a 2-ring: 2 s). dev0's
    wait for dev1 [1, 3] is bubble; dev1, which waits on nothing, is the one reported."""
    programs = tuple(Program(d, (Forward(d, 0, stash=False), AllReduceShared(d, group=(0, 1), tensors=("w",))))
                     for d in (0, 1))
    result = simulate(programs, SimCost((1.0, 3.0), (0.0, 0.0), tensor_bytes={"w": 200.0}, bandwidth=100.0))
    splits = device_splits(result)
    _assert_split(splits[0], TimeSplit(0, 1.0, 2.0, 0.0, 0.0, 2.0, Bound.NETWORK))
    _assert_split(splits[1], TimeSplit(1, 3.0, 0.0, 0.0, 0.0, 2.0, Bound.COMPUTE))
    assert time_split(result) == splits[1]
    _sums_to_the_iteration(result)


# ---- plans -------------------------------------------------------------------------------------
SLOW_HOST_LINK = dict(memory="80GiB", peak_flops="100TFLOPS", memory_bandwidth="2TB/s", host_bandwidth="1GB/s")


@pytest.fixture(scope="module")
def swapping_plan() -> sw.Plan:
    """A 2-layer GPT-2 on two devices of a 1 GB/s host link, every state and stash swapped."""
    config = GPT2Config(n_layer=2, n_embd=128, n_head=4, vocab_size=1024, n_positions=128, bos_token_id=0,
                        eos_token_id=0)
    with torch.device("meta"):
        model = GPT2LMHeadModel(config)
    ids = torch.randint(0, 1024, (8, 64), generator=torch.Generator().manual_seed(0))
    return sw.plan(model, [sw.Device(f"cuda:{i}", **SLOW_HOST_LINK) for i in range(2)],
                   {"input_ids": ids, "labels": ids}, optimizer=functools.partial(torch.optim.AdamW, lr=1e-4),
                   swap="all", schedule="1f1b", microbatches=2)


def test_a_plan_that_swaps_shows_swap_dominating_and_pcie_bound(swapping_plan: sw.Plan) -> None:
    split = swapping_plan.predicted_split
    assert split is not None and split.bound is Bound.PCIE
    assert split.swap_s > split.iteration_s / 2 and split.swap_s == max(s for _, s in split.parts())
    assert split.iteration_s == pytest.approx(swapping_plan.predicted_iteration_s, rel=1e-12)
    assert split == time_split(sw.simulate(swapping_plan))  # from the timeline the prediction came from
    assert f"where the time goes (dev{split.device}, the busiest): {split}" in str(swapping_plan)
    assert "— bound: PCIe" in str(swapping_plan)


def test_a_plan_read_back_prints_the_same_and_an_old_one_loads(swapping_plan: sw.Plan) -> None:
    loaded = sw.Plan.from_json(swapping_plan.to_json())
    assert loaded == swapping_plan and str(loaded) == str(swapping_plan)
    old = json.loads(swapping_plan.to_json())
    del old["predicted_split"]  # plan.json written before the split was kept
    older = sw.Plan.from_json(json.dumps(old))
    assert older.predicted_split is None and "where the time goes" not in str(older)


@pytest.mark.parametrize("field, value, refusal", [
    ("bound", "luck", "not a valid Bound"),
    ("swap_s", -1.0, "predicted_split's swap seconds as -1.0"),
    ("bubble_s", "NaN", "predicted_split's bubble seconds as 'NaN'"),
    ("p2p_s", True, "predicted_split's p2p seconds as True"),
    ("device", 2, "predicted_split.device as 2"),
])
def test_a_crafted_split_is_refused_naming_it(swapping_plan: sw.Plan, field: str, value, refusal: str) -> None:
    data = json.loads(swapping_plan.to_json())
    data["predicted_split"][field] = value
    with pytest.raises(CheckpointError, match=refusal):
        sw.Plan.from_json(json.dumps(data))
