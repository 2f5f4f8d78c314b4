"""`sw.probe_accelerator(..., model=)`: the model being planned, timed at four microbatch sizes, gives
the accelerator's FLOP/s as its achieved rate (Srifty §4.2), fitted as time = overhead + FLOPs / rate.

The fit itself is proven on fake timings (exactly 1 ms + FLOPs / 1 GFLOP/s); the real probe on this
CPU is only checked for sense (these machines are noisy): a positive, measured figure whose note says
how it was made, and a plan over it predicting this CPU's step within 10x.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

import stagewise as sw
import stagewise.compiler.advice.probe_model as probe_model
from stagewise.catalogue.entries import Dtype
from stagewise.compiler.advice.probe_model import fit_rate, microbatch_sizes
from stagewise.compiler.compile.calibrate import best_seconds
from tests.models.gpt import TinyGPT, lm_loss
from tests.models.mlp import mlp

SGD = functools.partial(torch.optim.SGD, lr=0.01)


def _mlp_problem(batch: int = 32, width: int = 16) -> dict:
    torch.manual_seed(0)
    return dict(model=mlp(width=width), example_inputs=(torch.randn(batch, 8),), loss_fn=F.cross_entropy,
                example_target=torch.randint(0, 5, (batch,)))


def _fake_timing(overhead_s: float, rate: float):
    """best_seconds replaced: each step takes exactly overhead + its counted FLOPs / rate."""
    def seconds(step, *devices, repeats=1):
        with FlopCounterMode(display=False) as counter:
            step()
        return overhead_s + counter.get_total_flops() / rate
    return seconds


def test_the_model_probe_gives_a_measured_rate_named_by_its_sizes_and_leaves_the_model_alone():
    torch.manual_seed(0)
    model, ids = TinyGPT(), torch.randint(0, 64, (8, 16))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    catalogue = sw.probe_accelerator("CPU", "cpu", model=model, example_inputs=(ids,), loss_fn=lm_loss,
                                     example_target=ids)
    cpu = catalogue.accelerator("CPU")
    figure = cpu.peak_flops.fp32
    assert figure.value > 1e6 and cpu.measured and cpu.memory_bandwidth.value > 1e6
    assert [s.kind.value for s in figure.sources] == ["measured"]
    assert "TinyGPT forward+backward at microbatches 1, 2, 4, 8" in figure.note
    assert sw.parse_device_request("1xCPU", catalogue).devices[0].peak_flops == figure.value
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters()) and torch.equal(torch.get_rng_state(), rng)


def test_a_fake_timing_of_1ms_plus_flops_over_1e9_is_fitted_exactly(monkeypatch):
    """The fit recovers the rate and overhead the timings were made from; FLOPs grow with the size."""
    monkeypatch.setattr(probe_model, "best_seconds", _fake_timing(1e-3, 1e9))
    problem = _mlp_problem(batch=32)
    fit = probe_model.probe_model(problem.pop("model"), problem.pop("example_inputs"), torch.device("cpu"), Dtype.FP32,
                                  **problem)
    assert fit.fitted and fit.sizes == (4, 8, 16, 32)
    assert fit.rate == pytest.approx(1e9, rel=1e-6) and fit.overhead_s == pytest.approx(1e-3, rel=1e-6)
    assert [f / fit.flops[0] for f in fit.flops] == pytest.approx([1, 2, 4, 8])
    catalogue = sw.probe_accelerator("CPU", "cpu", **_mlp_problem(batch=32))
    figure = catalogue.accelerator("CPU").peak_flops.fp32
    assert figure.value == pytest.approx(1e9, rel=1e-6)
    assert figure.note == ("fitted over Sequential forward+backward at microbatches 4, 8, 16, 32: achieved rate, "
                           "overhead 1 ms")


def test_a_degenerate_fit_falls_back_to_the_best_ratio_and_says_so(monkeypatch):
    monkeypatch.setattr(probe_model, "best_seconds", lambda step, *devices, repeats=1: 2e-3)  # flat: no slope
    catalogue = sw.probe_accelerator("CPU", "cpu", **_mlp_problem(batch=8))
    figure = catalogue.accelerator("CPU").peak_flops.fp32
    largest = _mlp_problem(batch=8)
    with FlopCounterMode(display=False) as counter:
        F.cross_entropy(largest["model"](*largest["example_inputs"]), largest["example_target"]).backward()
    assert figure.value == pytest.approx(counter.get_total_flops() / 2e-3)
    assert figure.note.startswith("best FLOPs/time ratio over Sequential forward+backward at microbatches 1, 2, 4, 8")
    assert "degenerate" in figure.note
    # a slope but a negative overhead (noise) is degenerate too: the best ratio is the smallest size's
    rate, overhead, fitted = fit_rate((1e6, 2e6, 4e6, 8e6), (0.9e-3, 1.9e-3, 3.9e-3, 7.9e-3))
    assert not fitted and overhead == pytest.approx(-1e-4) and rate == pytest.approx(1e6 / 0.9e-3)


def test_microbatch_sizes_are_the_batch_over_1_2_4_8():
    assert microbatch_sizes(8) == (1, 2, 4, 8) and microbatch_sizes(64) == (8, 16, 32, 64)
    assert microbatch_sizes(12) == (1, 3, 6, 12)
    assert microbatch_sizes(3) == (1, 3) and microbatch_sizes(2) == (1, 2)


def test_what_a_user_can_get_wrong_is_named_with_the_fix():
    with pytest.raises(sw.BatchSizeError, match="at least two microbatch sizes; give example_inputs with a batch of 2"):
        sw.probe_accelerator("CPU", "cpu", **_mlp_problem(batch=1))
    with torch.device("meta"):
        meta = mlp()
    problem = {**_mlp_problem(), "model": meta}
    with pytest.raises(sw.ExampleInputsError, match="'0.weight' is on the meta device .* cannot be timed"):
        sw.probe_accelerator("CPU", "cpu", **problem)
    with pytest.raises(sw.OptionError, match="needs example_inputs= too"):
        sw.probe_accelerator("CPU", "cpu", model=mlp())
    with pytest.raises(sw.OptionError, match="pass model= as well"):
        sw.probe_accelerator("CPU", "cpu", example_inputs=(torch.randn(4, 8),))
    no_loss = {**_mlp_problem(), "loss_fn": None, "example_target": None}
    with pytest.raises(sw.LossError, match="scalar loss"):
        sw.probe_accelerator("CPU", "cpu", **no_loss)


def test_a_plan_over_the_probed_catalogue_predicts_this_cpus_step_within_10x():
    """Loose on purpose (a noisy shared CPU): the ratio measured for the report was near 1."""
    problem = _mlp_problem(batch=128, width=256)
    catalogue = sw.probe_accelerator("CPU", "cpu", **problem)
    model, inputs, target = problem["model"], problem["example_inputs"], problem["example_target"]
    plan = sw.plan(model, list(sw.parse_device_request("1xCPU", catalogue).devices), inputs, loss_fn=F.cross_entropy,
                   example_target=target, optimizer=SGD)
    optimizer = SGD(model.parameters())

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(model(*inputs), target).backward()
        optimizer.step()

    measured = best_seconds(step, torch.device("cpu"), repeats=5)
    assert 0.1 < plan.predicted_iteration_s / measured < 10
