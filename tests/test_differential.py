"""The simulator and the runtime interpret the same programs alike (one interpreter, two subclasses).

Each case compiles a model, runs one real step with the runtime and simulates the same programs
with the sizes the runtime measured; per device the bytes swapped in and out and the bytes sent
must agree exactly, the peak memory within 5%, and every stream must run the same instructions in
the same order. Varuna's run-time deviation is off on both sides here: it depends on timing,
which the two do not share (tests/test_opportunistic.py covers it).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import stagewise as sw
from stagewise.ir.instructions import Backward, Forward, Recompute, Stream
from stagewise.passes.simulate import SimCost, simulate, transfer_bytes
from tests.models.gpt import TinyGPT, lm_loss
from tests.reference import ADAMW

SPLITS = {
    "gpipe": (3, ["blocks.1", "blocks.3"]),
    "1f1b": (3, ["blocks.1", "blocks.3"]),
    "varuna": (3, ["blocks.1", "blocks.3"]),
    "interleaved": (2, ["blocks.0", "blocks.2", "blocks.3"]),
    "harmony-pp": (2, ["blocks.0", "blocks.2", "blocks.3"]),
    "harmony-dp": (2, ["blocks.2"]),
}
CASES = [(s, swap) for s in SPLITS for swap in ("off", "on", "all")] + [("1f1b", "per-device")]

# Where the two still disagree (measured, issue 9's note): harmony-dp with every stash swapped holds
# 882688 bytes per device in the runtime, 549904-755456 in the simulator (it never holds more than one
# pack's gradients at once there). strict: a case that starts agreeing fails here until it is taken out.
PEAK_GAPS = {("harmony-dp", "all")}


def known(gaps: set, reason: str) -> list:
    return [pytest.param(*case, marks=pytest.mark.xfail(strict=True, reason=reason)) if case in gaps else case
            for case in CASES]


def run_both(schedule: str, swap: str, clip: float | None = 1.0):
    torch.manual_seed(0)
    ids = torch.randint(0, 64, (8, 16))
    devices, splits = SPLITS[schedule]
    pipe = sw.compile(TinyGPT(), [sw.Device("cpu") for _ in range(devices)], (ids,), loss_fn=lm_loss,
                      example_target=ids, optimizer=ADAMW, schedule=schedule, microbatches=4, cost="analytic",
                      split_points=splits, swap=swap, clip_grad_norm=clip)
    pipe.executor.opportunistic = False
    pipe.step(ids, target=ids)  # the first step creates the optimizer state
    before = [dict(s) for s in pipe.stats]
    pipe.step(ids, target=ids)
    moved = ("swap_in_bytes", "swap_out_bytes", "p2p_bytes")  # this step's, not the first's
    measured = [{**{k: s[k] - b[k] for k in moved}, "peak_bytes": s["peak_bytes"]}
                for s, b in zip(pipe.stats, before, strict=True)]
    cost = measured_cost(pipe)
    predicted = simulate(pipe.plan.programs, cost, opportunistic=False)
    # swaps as slow as ten microbatches' compute: what the runtime's memory peak can reach when its
    # copies lag (the simulated peak above, with instant copies, is what it reaches when they do not)
    slow = replace(cost, host_bandwidth=max(cost.stash_bytes + cost.grad_bytes) / 1e-2)
    return pipe, measured, (predicted, simulate(pipe.plan.programs, slow, opportunistic=False))


def measured_cost(pipe) -> SimCost:
    """The plan's programs, charged the sizes the runtime holds: state per stage and stash per microbatch."""
    stages = pipe.plan.stages
    state, grads = [0.0] * len(stages), [0.0] * len(stages)
    for worker in pipe.workers:
        layers = pipe.plan.layers  # a swapped stage's parameters are empty on the device between uses
        grads[worker.stage.index] = float(sum(layers[i].param_bytes for i in worker.stage.layers))
        if not worker.swapped:  # weights, optimizer state and buffers stay; gradients come and go
            weights = sum(p.numel() * p.element_size() for p in worker.params.values())
            optimizer = sum(t.numel() * t.element_size() for t in worker.tensors("optimizer").values())
            buffers = sum(b.numel() * b.element_size() for b in worker.module.buffers())
            state[worker.stage.index] = float(weights + optimizer + buffers)
    stash = [0.0] * len(stages)
    for worker in pipe.workers:
        stash[worker.stage.index] = float(worker.stash_size.get(True, 0))
    return SimCost(forward_s=(1e-3,) * len(stages), backward_s=(2e-3,) * len(stages), state_bytes=tuple(state), grad_bytes=tuple(grads),
                   stash_bytes=tuple(stash), value_bytes=transfer_bytes(pipe.plan.transfers, pipe.plan.microbatch_size))


def stream_orders(pipe) -> dict[tuple[int, Stream], list[int]]:
    runs: dict[tuple[int, Stream], list[tuple[float, int]]] = {}
    for device, stream, index, start, _ in pipe.executor.timeline:
        runs.setdefault((device, stream), []).append((start, index))
    return {key: [i for _, i in sorted(v)] for key, v in runs.items()}


@pytest.fixture(scope="module")
def runs():
    """One compile and step per case, shared by the comparisons below."""
    cache: dict = {}

    def get(schedule: str, swap: str):
        if (schedule, swap) not in cache:
            cache[(schedule, swap)] = run_both(schedule, swap)
        return cache[(schedule, swap)]
    return get


@pytest.mark.parametrize(("schedule", "swap"), CASES)
def test_bytes_sent_and_stream_order_agree(runs, schedule: str, swap: str) -> None:
    pipe, measured, (predicted, _) = runs(schedule, swap)
    assert [m["p2p_bytes"] for m in measured] == [predicted.p2p_bytes[d] for d in range(len(measured))]
    simulated: dict[tuple[int, Stream], list[int]] = {}
    for span in predicted.timeline:
        simulated.setdefault((span.device, span.stream), []).append(span.index)
    assert stream_orders(pipe) == simulated


@pytest.mark.parametrize(("schedule", "swap"), CASES)
def test_bytes_swapped_agree(runs, schedule: str, swap: str) -> None:
    _, measured, (predicted, _) = runs(schedule, swap)
    assert [m["swap_in_bytes"] for m in measured] == [predicted.swap_in_bytes[d] for d in range(len(measured))]
    assert [m["swap_out_bytes"] for m in measured] == [predicted.swap_out_bytes[d] for d in range(len(measured))]


@pytest.mark.parametrize(("schedule", "swap"), known(PEAK_GAPS, "the simulator's memory model is incomplete"))
def test_peak_memory_agrees(runs, schedule: str, swap: str) -> None:
    """Within 5% of the simulated peak; where copies overlap compute the runtime's peak depends on how
    far they lag, so it must lie (5%) between the peaks simulated with instant and with slow copies."""
    _, measured, (fast, slow) = runs(schedule, swap)
    for device, stats in enumerate(measured):
        low, high = sorted((fast.peak_bytes[device], slow.peak_bytes[device]))
        assert 0.95 * low <= stats["peak_bytes"] <= 1.05 * high, (device, stats["peak_bytes"], low, high)


def test_every_compute_runs_on_both() -> None:
    pipe, _, (predicted, _) = run_both("varuna", "off", clip=None)
    kinds = {type(s.instruction) for s in predicted.timeline}
    assert {Forward, Recompute, Backward} <= kinds
    assert len(pipe.executor.timeline) == len(predicted.timeline) == sum(len(p.instructions) for p in pipe.plan.programs)
