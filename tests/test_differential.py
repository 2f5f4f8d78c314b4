"""The simulator and the runtime interpret the same programs alike (one interpreter, two subclasses).

Each case compiles a model, runs one real step with the runtime and simulates the same programs
with the sizes the runtime measured; per device the bytes swapped in and out and the bytes sent
must agree exactly, the peak memory within 5%, and every stream must run the same instructions in
the same order. Varuna's run-time deviation is off on both sides here: it depends on timing,
which the two do not share (tests/test_opportunistic.py covers it).
"""

from __future__ import annotations

import pytest
import torch

import stagewise as sw
from stagewise.ir.instructions import Backward, Forward, Recompute, Stream
from tests.harness.measured import assert_peaks_agree, measured_cost, stream_orders, timing_variants
from tests.models.gpt import TinyGPT, lm_loss
from tests.reference import ADAMW

SPLITS = {
    "gpipe": (3, ["blocks.1", "blocks.3"]),
    "1f1b": (3, ["blocks.1", "blocks.3"]),
    "zb-h1": (3, ["blocks.1", "blocks.3"]),
    "varuna": (3, ["blocks.1", "blocks.3"]),
    "interleaved": (2, ["blocks.0", "blocks.2", "blocks.3"]),
    "zb-v": (2, ["blocks.0", "blocks.2", "blocks.3"]),
    "harmony-pp": (2, ["blocks.0", "blocks.2", "blocks.3"]),
    "harmony-dp": (2, ["blocks.2"]),
}
# zb-v lowers as interleaved and zb-h1 do, each covered with every swap mode: its "all" case alone (the suite's time)
CASES = ([(s, swap) for s in SPLITS if s != "zb-v" for swap in ("off", "on", "all")]
         + [("1f1b", "per-device"), ("zb-v", "all")])

def run_both(schedule: str, swap: str, **options):
    torch.manual_seed(0)
    ids = torch.randint(0, 64, (8, 16))
    devices, splits = SPLITS[schedule]
    pipe = sw.compile(TinyGPT(), [sw.Device("cpu") for _ in range(devices)], (ids,), loss_fn=lm_loss,
                      example_target=ids, optimizer=ADAMW, schedule=schedule, microbatches=4, cost="analytic",
                      split_points=splits, swap=swap, clip_grad_norm=1.0, **options)
    pipe._executor.state.opportunistic = False
    pipe.step(ids, target=ids)  # the first step creates the optimizer state
    before = [dict(s) for s in pipe.stats]
    pipe.step(ids, target=ids)
    moved = ("swap_in_bytes", "swap_out_bytes", "p2p_bytes")  # this step's, not the first's
    measured = [{**{k: s[k] - b[k] for k in moved}, "peak_bytes": s["peak_bytes"]}
                for s, b in zip(pipe.stats, before, strict=True)]
    simulated = timing_variants(pipe, measured_cost(pipe))
    return pipe, measured, (simulated.variants[0], simulated)  # the first: measured seconds, instant copies


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


@pytest.mark.parametrize(("schedule", "swap"), CASES)
def test_peak_memory_agrees(runs, schedule: str, swap: str) -> None:
    """Within 5% of the range of peaks simulated over the timings the runtime may run with (instant or
    lagging copies; measured or nominal compute): where nothing overlaps, that range is one value. A
    peak outside gets another fresh run (tests/harness/measured.py says why)."""
    assert_peaks_agree(_runs_from(runs(schedule, swap), schedule, swap))


def _runs_from(first, schedule: str, swap: str, **options):
    """A run for `assert_peaks_agree`: `first` (already run), then fresh ones."""
    pending = [first]

    def run():
        _, measured, (_, variants) = pending.pop() if pending else run_both(schedule, swap, **options)
        return measured, variants
    return run


def test_every_compute_runs_on_both(runs) -> None:
    """Varuna recomputes: every forward, recompute, backward and update of the programs runs on both."""
    pipe, _, (predicted, _) = runs("varuna", "off")
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
    assert_peaks_agree(_runs_from((pipe, measured, (predicted, variants)), "1f1b", "on", activations="recompute"))
