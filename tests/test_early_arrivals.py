"""The planner charges a device with a memory limit the peak it reaches when its messages arrive as
early as they can (passes/early_arrivals.py): the runtime meets that timing when a device lags its
senders, and a plan that fits only the nominal one fails mid-step with a CapacityError.

The case: TinyGPT on 2 devices, 1F1B over 2 microbatches, the embeddings alone on device 0. Nominally
device 1 (four blocks and the head) sends the second microbatch's gradient after device 0's first
backward ended; with device 0 slow it arrives during it, one transfer buffer more (seen on a CI run:
71,936 B held where one simulated timing gave 61,696).
"""

from __future__ import annotations

import time
import warnings
from dataclasses import replace

import pytest
import torch

import stagewise as sw
import stagewise.passes.early_arrivals as early_arrivals
from stagewise.ir.instructions import Recv
from stagewise.passes.costs import plan_charges
from stagewise.passes.early_arrivals import early_arrival_peaks
from stagewise.passes.simulate import simulate
from stagewise.runtime.worker import StageWorker
from tests.harness.measured import nominal_and_early
from tests.harness.precision import SGD
from tests.models.gpt import TinyGPT, lm_loss
from tests.reference import ATOL, RTOL, assert_state_equal, eager_train, pipeline_train, token_batches


def compile_at(memory: list[int | None], activations: str = "keep") -> sw.Pipeline:
    torch.manual_seed(1)
    ids = torch.randint(0, 64, (8, 16))
    return sw.compile(TinyGPT(), [sw.Device("cpu", memory=m) for m in memory], (ids,), loss_fn=lm_loss,
                      example_target=ids, optimizer=SGD, microbatches=2, schedule="1f1b", split_points=["blocks.0"],
                      cost="analytic", swap="off", activations=activations)


@pytest.fixture(scope="module")
def unbounded() -> sw.Pipeline:
    return compile_at([None, None])


def test_the_second_gradient_arriving_during_the_first_backward_is_charged(unbounded) -> None:
    programs, cost = unbounded.plan.programs, plan_charges(unbounded.plan)
    nominal, worst = nominal_and_early(unbounded.plan)
    second_gradient = next(ins for ins in programs[0].instructions if isinstance(ins, Recv) and ins.microbatch == 1)
    assert worst[0] == nominal[0] + cost.bytes_of(second_gradient) > nominal[0]
    assert worst[1] >= nominal[1]


def test_a_plan_at_its_nominal_peak_does_not_fit_and_the_planner_finds_one_that_does(unbounded) -> None:
    """Memory equal to the nominal peak compiled without a word before, and could fail mid-step. Now
    the plan asked for is said not to fit; the planner, free to choose each stage's activations,
    recomputes device 0's instead; the early-arrival peak is the kept plan's predicted peak."""
    nominal, worst = nominal_and_early(unbounded.plan)
    with pytest.warns(sw.DoesNotFitWarning, match="device 0 would need"):
        compile_at([int(nominal[0]), None])
    with warnings.catch_warnings():
        warnings.simplefilter("error", sw.DoesNotFitWarning)
        chosen = compile_at([int(nominal[0]), None], activations="auto")
        kept = compile_at([worst[0], None])
    assert str(chosen.plan.stages[0].activations) == "recompute"
    assert chosen.plan.predicted_peak_bytes[0] <= nominal[0]
    assert kept.plan.predicted_peak_bytes[0] == worst[0]


def test_only_devices_with_a_limit_they_fit_nominally_are_simulated_again(unbounded, monkeypatch) -> None:
    """A device without a limit decides nothing, one over its limit is out already: neither costs a simulation."""
    programs, cost = unbounded.plan.programs, plan_charges(unbounded.plan)
    nominal = simulate(programs, cost).peak_bytes
    slowed = []
    monkeypatch.setattr(early_arrivals, "simulate",
                        lambda programs, cost: slowed.append(set(cost.slowed)) or simulate(programs, cost))
    specs = unbounded.plan.devices
    assert early_arrival_peaks(programs, cost, specs, nominal) == tuple(int(p) for p in nominal.values())
    over = [replace(specs[0], memory=int(nominal[0]) - 1), replace(specs[1], memory=int(nominal[1]))]
    early_arrival_peaks(programs, cost, over, nominal)
    assert slowed == [{1}]


def _slow_first_backward(monkeypatch) -> None:
    """Device 0's first backward takes 50 ms more once begun: device 1's second gradient arrives during it,
    before it freed its stash (the early timing, made certain)."""
    seeds = StageWorker._seeds

    def slowed(worker: StageWorker, microbatch: int, loss_scale: float):
        if worker.stage.index == 0 and microbatch == 0:
            time.sleep(0.05)
        return seeds(worker, microbatch, loss_scale)
    monkeypatch.setattr(StageWorker, "_seeds", slowed)


def test_a_message_arriving_before_its_receiver_freed_memory_waits_for_it(unbounded, monkeypatch) -> None:
    """A plan kept as asked at device 0's nominal peak (said not to fit): the second gradient, early, waits
    for device 0's first backward to free memory instead of taking what its gradients need (a CapacityError
    at that backward before), and training equals eager's, device 0 never above its memory."""
    nominal, _ = nominal_and_early(unbounded.plan)
    _slow_first_backward(monkeypatch)
    with pytest.warns(sw.DoesNotFitWarning):
        pipe = compile_at([int(nominal[0]), None])
    torch.manual_seed(1)
    torch.randint(0, 64, (8, 16))  # as compile_at draws its example before the model
    model = TinyGPT()
    batches = token_batches(steps=2, batch=8, length=16)
    losses = [float(loss) for loss in pipeline_train(pipe, batches)]
    eager = [float(loss) for loss in eager_train(model, batches, loss_fn=lm_loss, microbatches=2)]
    assert losses == pytest.approx(eager, rel=RTOL, abs=ATOL)
    assert_state_equal(pipe.state_dict(), model.state_dict())
    assert pipe.stats[0]["peak_bytes"] <= int(nominal[0])


def test_a_message_no_freed_memory_can_hold_fails_naming_the_device_and_bytes(unbounded) -> None:
    """Device 1 short of room for the first activation whatever it frees: the message waits, nothing frees
    memory before device 1 receives it, and the step fails at once with a CapacityError naming the device
    and the bytes (not a hang)."""
    nominal, _ = nominal_and_early(unbounded.plan)
    state = unbounded.stats[1]
    room = state["weights_bytes"] + state["buffers_bytes"] + state["optimizer_bytes"]
    with pytest.warns(sw.DoesNotFitWarning):
        pipe = compile_at([None, int(room) + 1])
    with pytest.raises(sw.CapacityError, match=r"device 1 \(cpu\) needs [0-9.]+ [KM]?i?B more for buffer .* no "
                                               r"instruction will free memory"):
        pipeline_train(pipe, token_batches(steps=1, batch=8, length=16))
