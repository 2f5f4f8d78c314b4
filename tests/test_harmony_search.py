"""harmony-pp / harmony-dp plans come from Harmony's Alg. 1 and Alg. 2 (passes/harmony_packing.py):
the packs a compile runs are the ones Alg. 2 returns for the same costs, Alg. 1 picks the microbatch
size its estimator (our simulator) scores fastest, restricted to U_F = U_B and P_F = P_B, and the
plans it picks train exactly like eager training.

The paper gives no worked numbers for Alg. 1 or 2 (Tables 1 and 6 report packs of models profiled on
its GPUs); its Appendix A reduction is checked in tests/test_planner_algorithms.py.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import stagewise as sw
from stagewise.ir.plan import Cut, LayerCost
from stagewise.passes.harmony_packing import (
    BACKWARD,
    Configuration,
    balanced_time_packing,
    search_configuration,
)
from stagewise.passes.harmony_plan import PackUnits, search_packs
from stagewise.passes.pipedream_dp import NoFeasiblePlan
from stagewise.passes.planner import PLAN_MARGIN, candidates
from tests.harmony_oracle import FunctionCosts
from tests.models.gpt import TinyGPT, lm_loss
from tests.models.mlp import mlp
from tests.reference import ADAMW, SGD, assert_state_equal, eager_train, pipeline_train, token_batches


def weight_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def paper_phi(costs: tuple[LayerCost, ...]) -> FunctionCosts:
    """Alg. 2's profile as passes/harmony_plan.py defines it, written out again: a layer's forward and
    backward seconds, and its training state, one microbatch's stash and its workspace."""
    return FunctionCosts(lambda phase, u, i: costs[i].fwd_s + costs[i].bwd_s,
                         lambda phase, u, i: costs[i].state_bytes + costs[i].stash_bytes + costs[i].workspace_bytes)


def alg2_starts(pipe, capacity: float, fewest: int) -> list[int]:
    """The packs' first layers Alg. 2 returns for the costs the plan recorded (every cut legal), with
    alpha half the device (two packs resident), or all of it where a layer needs more than half."""
    assert all(cut.legal for cut in pipe.plan.cuts)
    costs, size = pipe.plan.costs.layers, pipe.plan.microbatch_size
    phi = paper_phi(costs)
    alpha = capacity / 2 if all(phi.memory(BACKWARD, size, i) <= capacity / 2 for i in range(len(costs))) else capacity
    packs = balanced_time_packing(BACKWARD, size, phi, alpha, n_layers=len(costs), fewest=fewest)
    return [pack.start for pack in packs]


def pack_starts(pipe) -> list[int]:
    return [s.layers[0] for s in pipe.plan.stages if s.replica == 0]


def gpt_on_devices(capacity_in_weights: float, schedule: str, microbatches: int | None):
    model = TinyGPT(layers=6, dim=96)
    capacity = int(capacity_in_weights * weight_bytes(model))
    x, y = token_batches(1)[0]
    devices = [sw.Device("cpu", memory=capacity) for _ in range(2)]
    pipe = sw.compile(model, devices, x, loss_fn=lm_loss, example_target=y, schedule=schedule,
                      microbatches=microbatches, optimizer=ADAMW, cost="analytic")
    return pipe, capacity


def fitting_rows(pipe) -> dict[int, float]:
    """Microbatch count -> predicted ms of every configuration the search scored that fits."""
    rows = [line.split() for line in pipe.plan.considered]
    return {int(row[1][1:]): float(row[2]) for row in rows if "fits" in row}  # "fits", then the chosen row's note


@pytest.mark.parametrize("schedule", ["harmony-pp", "harmony-dp"])
@pytest.mark.parametrize("weights", [1.2, 2.0])  # a block needs more than half the device / less
def test_compiled_packs_are_what_alg2_returns_for_the_same_costs(schedule, weights):
    pipe, capacity = gpt_on_devices(weights, schedule, microbatches=2)
    assert max(pipe.plan.predicted_peak_bytes) <= capacity  # the simulator's check added no pack
    fewest = 4 if schedule == "harmony-pp" else 2  # two packs per device of a lane (passes/layout.py)
    assert pack_starts(pipe) == alg2_starts(pipe, capacity, fewest)
    assert len(pack_starts(pipe)) > fewest  # memory, not the floor, decided the number of packs


def test_alg1_sweeps_every_microbatch_size_and_keeps_the_fastest_that_fits():
    """Alg. 1 keeps the fastest configuration that fits; where a simpler one (fewer microbatches) is
    within PLAN_MARGIN of it, that one, so identical compiles keep one plan (issue 10)."""
    pipe, capacity = gpt_on_devices(1.2, "harmony-pp", microbatches=None)
    assert sorted(int(line.split()[1][1:]) for line in pipe.plan.considered) == [1, 2, 4, 8]  # U = 8, 4, 2, 1
    fitting = fitting_rows(pipe)
    fastest = min(fitting.values())
    assert fitting[pipe.plan.microbatches] <= fastest * (1 + PLAN_MARGIN)
    assert all(fitting[m] > fastest * (1 + PLAN_MARGIN) for m in fitting if m < pipe.plan.microbatches)
    assert pack_starts(pipe) == alg2_starts(pipe, capacity, fewest=4)


def test_harmony_dp_sweeps_the_sizes_that_split_the_samples_per_device():
    """Alg. 1 lines 1-3: under Harmony DP each device takes D / N samples, so U is at most 4 of 8."""
    pipe, _ = gpt_on_devices(1.2, "harmony-dp", microbatches=None)
    assert sorted(int(line.split()[1][1:]) for line in pipe.plan.considered) == [2, 4, 8]


def test_a_packing_the_simulator_finds_over_memory_gets_more_packs():
    """Alg. 2 sums a pack's layers; the simulator also counts the next pack and the stashes in flight.
    Here Alg. 2's packing would not fit by the simulator's count, so the plan runs more packs."""
    pipe, capacity = gpt_on_devices(1.0, "harmony-dp", microbatches=2)
    first = alg2_starts(pipe, capacity, fewest=2)
    assert len(pack_starts(pipe)) > len(first)
    assert max(pipe.plan.predicted_peak_bytes) <= capacity
    names = [pipe.plan.layers[i].name for i in first[1:]]
    model = TinyGPT(layers=6, dim=96)
    x, y = token_batches(1)[0]
    devices = [sw.Device("cpu", memory=capacity) for _ in range(2)]
    as_alg2 = sw.compile(model, devices, x, loss_fn=lm_loss, example_target=y,
                         schedule="harmony-dp", microbatches=2, optimizer=ADAMW, cost="analytic", split_points=names)
    assert pack_starts(as_alg2) == first and max(as_alg2.plan.predicted_peak_bytes) > capacity


def check_searched_training(model, batches, devices, loss_fn, optimizer, **options):
    """Compile with the microbatch count left to Alg. 1, then train beside eager training at that count."""
    reference = copy.deepcopy(model)
    inputs, target = batches[0]
    pipe = sw.compile(model, devices, inputs, loss_fn=loss_fn, example_target=target, optimizer=optimizer, **options)
    assert pipe.plan.considered  # Alg. 1 searched
    got = pipeline_train(pipe, batches)
    want = eager_train(reference, batches, loss_fn=loss_fn, optimizer=optimizer, microbatches=pipe.plan.microbatches)
    torch.testing.assert_close(torch.stack(got), torch.stack(want), rtol=1e-5, atol=1e-6)
    assert_state_equal(pipe.state_dict(), reference.state_dict())
    return pipe


@pytest.mark.parametrize("schedule", ["harmony-pp", "harmony-dp"])
def test_tied_gpt_trains_like_eager_on_the_searched_plan(schedule):
    pipe = check_searched_training(TinyGPT(layers=4), token_batches(), 2, lm_loss, ADAMW, schedule=schedule, swap="on")
    assert sum(s["swap_in_bytes"] for s in pipe.stats) > 0


@pytest.mark.parametrize("schedule", ["harmony-pp", "harmony-dp"])
def test_mlp_trains_like_eager_on_the_searched_plan(schedule):
    batches = [((torch.randn(8, 8),), torch.randint(0, 5, (8,))) for _ in range(3)]
    pipe = check_searched_training(mlp(), batches, 2, F.cross_entropy, SGD, schedule=schedule, swap="on")
    assert sum(s["swap_in_bytes"] for s in pipe.stats) > 0


def test_model_larger_than_the_devices_trains_like_eager_within_capacity():
    model = TinyGPT(layers=6, dim=96)
    capacity = weight_bytes(model)  # a quarter of weights, gradients and AdamW moments
    devices = [sw.Device("cpu", memory=capacity) for _ in range(2)]
    pipe = check_searched_training(model, token_batches(batch=4), devices, lm_loss, ADAMW, schedule="harmony-pp")
    for stats in pipe.stats:
        assert 0 < stats["peak_bytes"] <= capacity


# --------------------------------------------------------------------------- the search on plain numbers


def uniform(n: int) -> FunctionCosts:
    return FunctionCosts(lambda phase, u, i: 1.0 * u, lambda phase, u, i: 1.0 * u)


def test_the_product_search_is_restricted_to_one_size_and_one_packing():
    """U_F = U_B and P_F = P_B: the packs are Alg. 2's backward packing (Alg. 1 line 7) at each size."""
    seen: list[Configuration] = []

    def estimator(config: Configuration) -> float:
        seen.append(config)
        return abs(config.backward_microbatch - 2)

    result = search_configuration(12, [1, 2, 4, 8], uniform(12), 6.0, estimator, fewest=2)
    assert [c.backward_microbatch for c in seen] == [1, 2, 4]  # at 8, a layer needs 8 of the 6 bytes
    assert all(c.forward_microbatch == c.backward_microbatch and c.forward_packs == c.backward_packs for c in seen)
    assert all(c.backward_packs == balanced_time_packing(BACKWARD, c.backward_microbatch, uniform(12), 6.0,
                                                         n_layers=12, fewest=2) for c in seen)
    assert result.config.backward_microbatch == 2 and result.explored == 3
    with pytest.raises(NoFeasiblePlan, match="no microbatch size"):
        search_configuration(12, [16], uniform(12), 8.0, estimator)


def test_the_floor_on_packs_applies_only_where_memory_asks_for_fewer():
    assert len(balanced_time_packing(BACKWARD, 1, uniform(12), 100.0, n_layers=12, fewest=4)) == 4
    assert len(balanced_time_packing(BACKWARD, 1, uniform(12), 2.0, n_layers=12, fewest=4)) == 6


def test_packs_end_only_at_legal_cuts():
    cuts = [Cut(i, (), legal=i not in (0, 3)) for i in range(5)]  # 6 layers; no cut after 0 or 3
    units = PackUnits.of(cuts, 6)
    assert [units.layers(j) for j in range(len(units))] == [range(0, 2), range(2, 3), range(3, 5), range(5, 6)]
    assert units.starts((range(0, 2), range(2, 4))) == [0, 3]  # unit packs {0, 1} and {2, 3}


def layer_cost(i: int, seconds: float, state: int) -> LayerCost:
    return LayerCost(i, 1, seconds / 3, 2 * seconds / 3, seconds / 3, state, 0, 0, 0, 0, 0)


def test_search_packs_goes_on_to_more_packs_while_the_simulator_says_no():
    costs = [layer_cost(i, 1.0, 1) for i in range(8)]
    cuts = [Cut(i, (), legal=True) for i in range(7)]
    asked: list[list[int]] = []

    def fits(size: int, starts: list[int]) -> bool:
        asked.append(starts)
        return len(starts) >= 4

    size, starts = search_packs([1], 8, lambda u: costs, cuts, [], 2, lambda size, starts: 0.0, fits)
    assert [len(s) for s in asked] == [2, 3, 4] and starts == [0, 2, 4, 6] and size == 1


def test_harmony_candidates_cover_every_microbatch_size():
    counts = {c.microbatches for c in candidates("harmony-pp", None, 64, 2, 10, True)}
    assert counts == {1, 2, 4, 8, 16, 32, 64}  # gpipe and 1f1b stop at 8 per device
    assert {c.microbatches for c in candidates("harmony-dp", None, 64, 2, 10, True)} == {2, 4, 8, 16, 32, 64}
