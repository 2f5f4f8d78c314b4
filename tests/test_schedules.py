"""Schedules: their task orders match the papers, their bubbles the formulas, their training eager's."""

import pytest
import torch

from stagewise.ir.instructions import Phase
from stagewise.ir.plan import Stage, Transfer
from stagewise.passes.lower import lower
from stagewise.passes.schedule import (
    REPLICATED_STAGE_SCHEDULES,
    SCHEDULES,
    instance_tasks,
    interleaved,
    schedule_tasks,
    varuna,
)
from stagewise.passes.simulate import SimCost, simulate
from tests.hf import gpt2, lm_batches
from tests.models.gpt import TinyGPT, lm_loss
from tests.reference import ADAMW, SGD, check_equal_training, first_device_peak


def orders(tasks):
    return [" ".join(f"{t.phase.value}{t.microbatch + 1}" for t in device if t.phase is not Phase.UPDATE)
            for device in tasks]


def test_varuna_reproduces_figure_4():
    """Varuna Fig. 4(a): 4 stages, 5 microbatches, Tb = 2 Tf; S4 is the last stage."""
    s1, s2, s3, s4 = orders(varuna(4, 5))
    assert s4 == "F1 B1 F2 B2 F3 B3 F4 B4 F5 B5"
    assert s3 == "F1 F2 F3 R1 B1 R2 B2 R3 B3 F4 F5 R4 B4 R5 B5"
    assert s2 == "F1 F2 F3 F4 F5 R1 B1 R2 B2 R3 B3 R4 B4 R5 B5"
    assert s1 == s2


def test_varuna_recomputes_everywhere_but_the_last_stage():
    tasks = varuna(3, 4)
    assert not any(t.stash for t in tasks[0] + tasks[1] if t.phase is Phase.FORWARD)
    assert all(t.stash for t in tasks[2])
    for device in tasks[:2]:  # rule 2: a recompute is followed by its microbatch's backward
        for a, b in zip(device, device[1:], strict=False):
            if a.phase is Phase.RECOMPUTE:
                assert (b.phase, b.microbatch) == (Phase.BACKWARD, a.microbatch)


def test_interleaved_places_chunks_round_robin_and_covers_every_task():
    tasks = interleaved(n_devices=2, chunks=2, microbatches=4)
    for d, device in enumerate(tasks):
        assert {t.stage for t in device} == {d, d + 2}
        work = [(t.phase.value, t.stage, t.microbatch) for t in device if t.phase is not Phase.UPDATE]
        assert sorted(work) == sorted((k, s, mb) for k in "FB" for s in (d, d + 2) for mb in range(4))


def _passes_per_stage(tasks) -> dict[tuple[Phase, int], list[int]]:
    """Each (forward or backward or either half of one, stage instance): its microbatches in the order its
    device runs them."""
    passes: dict[tuple[Phase, int], list[int]] = {}
    for device in tasks:
        for t in device:
            if t.phase in (Phase.FORWARD, Phase.BACKWARD, Phase.INPUT_GRAD, Phase.WEIGHT_GRAD):
                passes.setdefault((t.phase, t.stage), []).append(t.microbatch)
    return passes


@pytest.mark.parametrize("schedule", [s for s in SCHEDULES if s != "auto"])
@pytest.mark.parametrize(("stages", "devices", "m"), [(4, 2, 4), (6, 3, 3), (8, 4, 8)])
def test_every_schedule_runs_each_stage_in_microbatch_order(schedule, stages, devices, m):
    """Forwards and backwards of every stage in microbatch order (0 first): BatchNorm's running statistics
    and every gradient's sum over microbatches then come out bitwise alike under every schedule."""
    n = stages if schedule in ("interleaved", "zb-v", "harmony-pp", "harmony-dp") else devices
    _, tasks = schedule_tasks(schedule, n, m, devices)
    passes = _passes_per_stage(tasks)
    assert {stage for _, stage in passes} == set(range(n))
    assert all(order == list(range(m)) for order in passes.values()), passes


@pytest.mark.parametrize("schedule", REPLICATED_STAGE_SCHEDULES)
def test_stages_replicated_unevenly_run_their_microbatches_in_order(schedule):
    """A 2-1 plan: stage 0 on two devices (microbatches dealt round robin), stage 1 on one."""
    front = [Stage(r, r, (0,), (), ("a",), (), (), logical=0, replica=r, microbatches=(r, r + 2, r + 4)) for r in (0, 1)]
    back = Stage(2, 2, (1,), ("a",), ("loss",), (), (), logical=1)
    passes = _passes_per_stage(instance_tasks(schedule, (*front, back), 6, 3, jit_update=False))
    assert passes[(Phase.BACKWARD, 0)] == [0, 2, 4] and passes[(Phase.BACKWARD, 1)] == [1, 3, 5]
    assert passes[(Phase.FORWARD, 2)] == passes[(Phase.BACKWARD, 2)] == list(range(6))


def _chain(p: int) -> tuple[tuple[Stage, ...], tuple[Transfer, ...]]:
    stages = tuple(Stage(s, s, (s,), (), (), (), ()) for s in range(p))
    transfers = tuple(Transfer(f"v{s}", s, s + 1, 0.0, True) for s in range(p - 1))
    return stages, transfers


@pytest.mark.parametrize(("p", "v", "m"), [(2, 2, 4), (4, 2, 8), (4, 4, 8), (3, 2, 6)])
def test_interleaved_bubble_is_one_over_v_of_1f1b(p, v, m):
    """Narayanan §4.2.2: with v chunks per device the bubble is (1/v)(p - 1)/m."""
    n = p * v
    stages = tuple(Stage(s, s % p, (s,), (), (), (), ()) for s in range(n))
    transfers = tuple(Transfer(f"v{s}", s, s + 1, 0.0, True) for s in range(n - 1))
    _, tasks = schedule_tasks("interleaved", n, m, p)
    programs = lower(stages, transfers, (), tasks, clip_grad_norm=False)
    result = simulate(programs, SimCost.uniform(n, 1.0 / v, 2.0 / v))
    ideal = m * 3.0  # each device: m microbatches x v chunks x (1/v + 2/v)
    assert result.iteration_time == pytest.approx(ideal * (1 + (p - 1) / (v * m)))


@pytest.mark.parametrize(("schedule", "devices", "microbatches", "optimizer", "clip"), [
    ("interleaved", 2, 4, SGD, None), ("interleaved", 2, 2, ADAMW, 0.5),
    ("varuna", 3, 4, SGD, 0.5), ("varuna", 4, 4, ADAMW, None),
])
def test_schedules_train_like_eager_on_tied_gpt(schedule, devices, microbatches, optimizer, clip):
    ids = torch.randint(0, 64, (8, 9))
    batches = [((ids[:, :-1],), ids[:, 1:]) for _ in range(3)]
    pipe = check_equal_training(TinyGPT(layers=4), batches, devices, loss_fn=lm_loss, optimizer=optimizer,
                                microbatches=microbatches, clip_grad_norm=clip, schedule=schedule)
    assert pipe.plan.schedule == schedule
    if schedule == "interleaved":
        assert len(pipe.plan.stages) == 2 * devices and len(pipe.programs) == devices


@pytest.mark.parametrize("schedule", ["interleaved", "varuna"])
def test_schedules_train_like_eager_on_hf_gpt2(schedule):
    check_equal_training(gpt2(layers=4), lm_batches(), 2, optimizer=ADAMW, microbatches=2, clip_grad_norm=1.0,
                         schedule=schedule)


def test_varuna_stashes_less_than_gpipe():
    assert first_device_peak(TinyGPT(), 3, "varuna") < first_device_peak(TinyGPT(), 3, "gpipe")
