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
from stagewise.passes.simulate import simulate
from tests.harness.measured import measured_cost, stream_orders
from tests.models.gpt import TinyGPT, lm_loss
from tests.reference import ADAMW

SPLITS = {
    "gpipe": (3, ["blocks.1", "blocks.3"]),
    "1f1b": (3, ["blocks.1", "blocks.3"]),
    "zb-h1": (3, ["blocks.1", "blocks.3"]),
    "varuna": (3, ["blocks.1", "blocks.3"]),
    "interleaved": (2, ["blocks.0", "blocks.2", "blocks.3"]),
    "harmony-pp": (2, ["blocks.0", "blocks.2", "blocks.3"]),
    "harmony-dp": (2, ["blocks.2"]),
}
CASES = [(s, swap) for s in SPLITS for swap in ("off", "on", "all")] + [("1f1b", "per-device")]

def run_both(schedule: str, swap: str, clip: float | None = 1.0, **options):
    torch.manual_seed(0)
    ids = torch.randint(0, 64, (8, 16))
    devices, splits = SPLITS[schedule]
    pipe = sw.compile(TinyGPT(), [sw.Device("cpu") for _ in range(devices)], (ids,), loss_fn=lm_loss,
                      example_target=ids, optimizer=ADAMW, schedule=schedule, microbatches=4, cost="analytic",
                      split_points=splits, swap=swap, clip_grad_norm=clip, **options)
    pipe._executor.state.opportunistic = False
    pipe.step(ids, target=ids)  # the first step creates the optimizer state
    before = [dict(s) for s in pipe.stats]
    pipe.step(ids, target=ids)
    moved = ("swap_in_bytes", "swap_out_bytes", "p2p_bytes")  # this step's, not the first's
    measured = [{**{k: s[k] - b[k] for k in moved}, "peak_bytes": s["peak_bytes"]}
                for s, b in zip(pipe.stats, before, strict=True)]
    cost = measured_cost(pipe)
    # the runtime's peak is one timing among those it may run with: the same programs simulated with
    # instant copies, and with copies as slow as ten microbatches' compute (its copies lagging), each
    # with the step's measured compute seconds and with nominal ones (1 ms forward, 2 ms backward)
    nominal = replace(cost, forward_s=(1e-3,) * len(cost.forward_s), backward_s=(2e-3,) * len(cost.forward_s))
    variants = [replace(c, host_bandwidth=bandwidth) for c in (cost, nominal)
                for bandwidth in (cost.host_bandwidth, max(cost.stash_bytes + cost.grad_bytes) / 1e-2)]
    simulated = [simulate(pipe.plan.programs, c, opportunistic=False) for c in variants]
    return pipe, measured, (simulated[0], simulated)  # the first: measured seconds, instant copies


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


ATTEMPTS = 3  # steps (each on a fresh compile) a peak gets to fall within the simulated range


def _peaks_outside(measured, variants) -> list[tuple[int, int, list[float]]]:
    """(device, measured peak, simulated peaks) for each device whose peak lies outside 5% of the range."""
    outside = []
    for device, stats in enumerate(measured):
        peaks = [v.peak_bytes[device] for v in variants]
        if not 0.95 * min(peaks) <= stats["peak_bytes"] <= 1.05 * max(peaks):
            outside.append((device, stats["peak_bytes"], peaks))
    return outside


@pytest.mark.parametrize(("schedule", "swap"), CASES)
def test_peak_memory_agrees(runs, schedule: str, swap: str) -> None:
    """Within 5% of the range of peaks simulated over the timings the runtime may run with (instant or
    lagging copies; measured or nominal compute): where nothing overlaps, that range is one value.

    The runtime's peak depends on how the OS schedules its copy and message threads: on a loaded
    machine one step in many holds a stash or a few transfer buffers longer than any simulated timing
    (full-suite runs: varuna without swaps, five 4 KiB buffers; harmony-pp with every stash swapped,
    one 16 KiB stash). So a peak outside the range gets another step, up to ATTEMPTS: an accounting
    error (the ledger and the simulator disagree) is outside in every one and fails."""
    _, measured, (_, variants) = runs(schedule, swap)
    attempts = [_peaks_outside(measured, variants)]
    while attempts[-1] and len(attempts) < ATTEMPTS:
        _, measured, (_, variants) = run_both(schedule, swap)
        attempts.append(_peaks_outside(measured, variants))
    assert not attempts[-1], attempts


def test_every_compute_runs_on_both() -> None:
    pipe, _, (predicted, _) = run_both("varuna", "off", clip=None)
    kinds = {type(s.instruction) for s in predicted.timeline}
    assert {Forward, Recompute, Backward} <= kinds
    assert len(pipe._executor.state.step.timeline) == len(predicted.timeline) == sum(len(p.instructions) for p in pipe.plan.programs)


def test_a_plan_mixing_recompute_and_keep_agrees() -> None:
    """1F1B on 3 stages, the first two recomputing and the last keeping its stashes (the state swapped): the
    messages, swaps, stream orders and peaks of the runtime and the simulator agree as above."""
    pipe, measured, (predicted, variants) = run_both("1f1b", "on", activations="recompute")
    assert [str(stage.activations) for stage in pipe.plan.stages] == ["recompute", "recompute", "keep"]
    assert [m["p2p_bytes"] for m in measured] == [predicted.p2p_bytes[d] for d in range(len(measured))]
    assert [m["swap_in_bytes"] for m in measured] == [predicted.swap_in_bytes[d] for d in range(len(measured))]
    simulated: dict[tuple[int, Stream], list[int]] = {}
    for span in predicted.timeline:
        simulated.setdefault((span.device, span.stream), []).append(span.index)
    assert stream_orders(pipe) == simulated
    attempts = [_peaks_outside(measured, variants)]
    while attempts[-1] and len(attempts) < ATTEMPTS:
        _, measured, (_, variants) = run_both("1f1b", "on", activations="recompute")
        attempts.append(_peaks_outside(measured, variants))
    assert not attempts[-1], attempts
