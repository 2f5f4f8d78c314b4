"""bench/simulator_accuracy.py's diagnosis reads each step's own timeline: its "in pipeline" columns are
figures, not "-", whichever executor path runs the instructions (a patched dispatch was bypassed by the
prebound executor), and the stages' inputs are captured for timing them alone."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import _accuracy_timing as timing  # noqa: E402 - bench/ is on sys.path only from here
import simulator_accuracy as bench  # noqa: E402

STEPS = 2


@pytest.fixture(scope="module")
def recorded():
    model = bench.null_model(8)
    pipe = bench.compile_plan(model, 2, "1f1b", 4)
    times = timing.step_times(pipe, model, warmup=1, steps=STEPS, record=True)
    return pipe, times, bench.compute_ratios(pipe, STEPS)


def test_every_instruction_of_the_timed_steps_is_a_span_of_its_own_step(recorded):
    pipe, times, _ = recorded
    instructions = sum(len(p.instructions) for p in pipe.plan.programs)
    assert len(timing.RECORDER.spans) == STEPS * instructions
    assert all(start <= end for _, _, start, end in timing.RECORDER.spans)
    first, last = min(s[2] for s in timing.RECORDER.spans), max(s[3] for s in timing.RECORDER.spans)
    assert last - first <= sum(times)  # absolute times: the steps' spans do not pile onto one another


def test_the_in_pipeline_columns_are_figures(recorded):
    _, _, compute = recorded
    assert math.isfinite(compute.alone) and compute.alone > 0  # 1F1B's first forward runs alone
    assert math.isfinite(compute.cpu) and compute.cpu > 0  # the stream threads' CPU time was read
    assert compute.update > 0  # the optimizer's U instructions are in the timeline too
    assert bench._ratio(compute.alone) != "-"


def test_each_stage_is_captured_once_and_can_be_timed_alone(recorded):
    pipe, _, _ = recorded
    assert sorted(timing.RECORDER.inputs) == [w.stage.index for w in pipe._workers]
    plain, worker_path, _ = timing.stage_seconds(pipe, repeats=1)
    assert sorted(plain) == sorted(worker_path) == sorted(timing.RECORDER.inputs)
