"""The same model, devices and options get the same plan on every compile: candidates whose predicted
times differ by less than the planner's margin (profiling noise) are chosen by a fixed preference
order, never by which one the noise favoured, nor by the order they were tried in."""

import dataclasses
import itertools
import random
import time

import pytest
import torch

import stagewise as sw
import stagewise.compiler.compile.costing as costing
import stagewise.passes.planner as planner
import stagewise.passes.profile_cache as profile_cache
import stagewise.passes.profile_measure as profile_measure
from stagewise.ir.costs import RuntimeCosts
from stagewise.ir.topology import Topology
from stagewise.passes.planner import PLAN_MARGIN, Prediction, Simplicity, keep_simplest
from tests.models.gpt import TinyGPT, lm_loss

GPIPE = Simplicity(stages=2, schedule=0, microbatches=4, copies=1, placement=((0, 4), (0, 1)))
ONE_F_ONE_B = Simplicity(stages=2, schedule=1, microbatches=4, copies=1, placement=((0, 4), (0, 1)))
INTERLEAVED = Simplicity(stages=4, schedule=2, microbatches=4, copies=1, placement=((0, 2, 4, 6), (0, 1, 0, 1)))
GPIPE_MORE_MICROBATCHES = Simplicity(stages=2, schedule=0, microbatches=8, copies=1, placement=((0, 4), (0, 1)))


def _predicted(ms: float, fits: bool = True) -> Prediction:
    return Prediction(ms / 1e3, (ms / 2e3, ms / 2e3), (1, 1), fits)


def _kept(scored: list[tuple[Simplicity, Prediction]]) -> Simplicity:
    return scored[keep_simplest(scored)[0]][0]


def test_within_the_margin_the_simpler_plan_is_kept():
    slower_by = 1 + PLAN_MARGIN / 2
    scored = [(INTERLEAVED, _predicted(100.0)), (GPIPE, _predicted(100.0 * slower_by))]
    assert _kept(scored) == GPIPE
    assert keep_simplest(scored) == (1, 0)  # the fastest is still reported


def test_beyond_the_margin_the_faster_plan_is_kept():
    slower_by = 1 + PLAN_MARGIN * 1.5
    assert _kept([(INTERLEAVED, _predicted(100.0)), (GPIPE, _predicted(100.0 * slower_by))]) == INTERLEAVED


def test_fewer_microbatches_and_earlier_schedules_are_simpler():
    assert _kept([(GPIPE_MORE_MICROBATCHES, _predicted(100.0)), (GPIPE, _predicted(101.0))]) == GPIPE
    assert _kept([(ONE_F_ONE_B, _predicted(100.0)), (GPIPE, _predicted(101.0))]) == GPIPE


def test_plans_that_do_not_fit_are_never_kept():
    scored = [(GPIPE, _predicted(100.0, fits=False)), (INTERLEAVED, _predicted(104.0))]
    assert _kept(scored) == INTERLEAVED


@pytest.mark.parametrize("times", [(100.0, 100.0, 100.0), (100.0, 103.0, 101.0), (120.0, 100.0, 100.0)])
def test_ties_are_broken_by_the_fixed_order_never_by_the_order_tried(times):
    """Every order of the same candidates keeps the same plan."""
    scored = list(zip((INTERLEAVED, ONE_F_ONE_B, GPIPE), map(_predicted, times), strict=True))
    kept = {_kept(list(order)) for order in itertools.permutations(scored)}
    assert len(kept) == 1


@pytest.fixture(scope="module")
def runtime_measured_once():
    """What this machine measures at compile (the runtime's hand-offs and optimizer step, the links'
    bandwidth), fixed to the same figures on every run: measured under a varying load they moved
    the candidates' predictions, and a pair of candidates whose gap fell near the margin could then
    flip with the test's noise (a CI run chose x1 in one compile and x2 in another). Fixed, the
    candidates sit where they sit, and the test is about the noise alone."""
    measure = costing.runtime_costs

    def fixed_runtime(*args, **kwargs) -> RuntimeCosts:
        measured = measure(*args, **kwargs)
        return dataclasses.replace(measured, instruction_s=30e-6, wake_s=0.0,
                                   update_s=tuple(1e-4 for _ in measured.update_s))

    def fixed_links(devices) -> Topology:
        n = len(devices)
        return Topology.from_matrix([[None if i == j else 5e9 for j in range(n)] for i in range(n)])

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(costing, "runtime_costs", fixed_runtime)
        patch.setattr(costing, "local_topology", fixed_links)
        yield


def _compile_with_noise(seed: int, noise: float):
    """TinyGPT on 2 devices, analytic costs, every candidate's predicted time scaled by its own
    random factor in [1 - noise, 1 + noise]: what profiling noise does to the predictions."""
    rng = random.Random(seed)
    exact = planner.predict

    def noisy(*args, **kwargs):
        prediction, result = exact(*args, **kwargs)
        scaled = prediction.iteration_s * (1 + rng.uniform(-noise, noise))
        return Prediction(scaled, prediction.stage_s, prediction.peak_bytes, prediction.fits), result

    torch.manual_seed(0)
    ids = torch.randint(0, 64, (8, 9))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(planner, "predict", noisy)
        return sw.compile(TinyGPT(), 2, (ids[:, :-1],), loss_fn=lm_loss, example_target=ids[:, 1:], cost="analytic")


def _plan_of(pipe) -> tuple:
    plan = pipe.plan
    return plan.schedule, plan.microbatches, tuple(tuple(stage.layers) for stage in plan.stages)


def test_noise_below_the_margin_does_not_change_the_plan(runtime_measured_once):
    """Predictions perturbed by up to a fifth of the margin, differently on each compile, still give
    one plan; the table says which was chosen and why."""
    plans = {_plan_of(_compile_with_noise(seed, PLAN_MARGIN / 5)) for seed in range(4)}
    assert len(plans) == 1, plans
    pipe = _compile_with_noise(0, 0.0)
    chosen = [line for line in pipe.plan.considered if "<- chosen: " in line]
    assert len(chosen) == 1
    assert chosen[0].split()[:2] == [pipe.plan.schedule, f"x{pipe.plan.microbatches}"]
    assert float(chosen[0].split()[2]) == pytest.approx(pipe.plan.predicted_iteration_s * 1e3, abs=0.01)


class _BusyForAWhile:
    """A machine busy for part of the profile, made repeatable: the first `busy_runs` timed runs of the
    profiler's probes each take PREEMPTED_S longer, as a run takes when another process holds its core
    part of the time. (Real load is not repeatable here: a Python thread cannot disturb a timed run,
    since small torch ops keep the GIL, and another process's share of 2 shared cores varies.)"""

    PREEMPTED_S = 2e-3

    def __init__(self, monkeypatch, busy_runs: int):
        self.busy_runs, self.runs = busy_runs, 0
        real = profile_measure.timed

        def timed(fn, device):
            self.runs += 1
            if self.runs > self.busy_runs:
                return real(fn, device)
            return real(lambda: (time.sleep(self.PREEMPTED_S), fn())[1], device)

        monkeypatch.setattr(profile_measure, "timed", timed)


def _doubling_mlp() -> torch.nn.Module:
    """Blocks each twice as wide as the one before: the first five together cost about the last
    one, so one split (blocks 0-4 | 5 and the head) is clearly the best, by 20-30% (not a near tie
    that the noise of a quiet machine could flip)."""
    torch.manual_seed(0)
    blocks = [torch.nn.Sequential(torch.nn.Linear(128, 64 * 2**k), torch.nn.Tanh(), torch.nn.Linear(64 * 2**k, 128))
              for k in range(6)]
    return torch.nn.Sequential(*blocks, torch.nn.Linear(128, 4))


def test_a_machine_busy_for_part_of_the_profile_does_not_change_the_plan(tmp_path, monkeypatch):
    """The same model compiled three times in one process, the profile cache cleared before each
    (profiled afresh); during the second the machine is busy for the first 54 timed runs of the
    probes (a third of them). Each time is the least disturbed of rounds over all the layers, so the
    busy spell inflates none of them and the partition stays (a median of runs back to back kept
    the first layer's inflated times, and the split moved a block)."""
    x, y = torch.randn(64, 128), torch.randint(0, 4, (64,))
    plans = []
    for run in range(3):
        monkeypatch.setattr(profile_cache, "cache_dir", lambda run=run: tmp_path / f"profiles{run}")
        busy = _BusyForAWhile(monkeypatch, busy_runs=54 if run == 1 else 0)
        pipe = sw.compile(_doubling_mlp(), 2, (x,), loss_fn=torch.nn.functional.cross_entropy, example_target=y,
                          schedule="gpipe", microbatches=2, cost="profile")
        assert busy.runs > 3 * 54
        plans.append(_plan_of(pipe))
    assert plans[0] == plans[1] == plans[2], plans
