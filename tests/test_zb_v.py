"""ZB-V (issue 25; Qi et al., ICLR 2024, §6): two chunks per device in a V with the backward split into B and
W. Its order is torch.distributed.pipelining's ScheduleZBVZeroBubble (the paper gives it as a figure), its
simulated step beats ZB-H1's and 1F1B's at no more peak memory, it trains like eager (bitwise like 1F1B on
the same split), and it refuses a model too coarse for two stages per device."""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.pipelining.schedules import ScheduleZBVZeroBubble, _ComputationType

import stagewise as sw
from stagewise.ir.instructions import InputGrad, Phase, WeightGrad
from stagewise.passes.lower import lower
from stagewise.passes.planner import Candidate, Prediction
from stagewise.passes.schedule import schedule_tasks
from stagewise.passes.simulate import SimCost, simulate
from stagewise.passes.zb_v import v_device, zb_v
from stagewise.passes.zero_bubble_plans import finalists, weighs_split_backward, zero_bubble_candidates
from tests.harness.stages import chain
from tests.models.gpt import TinyGPT, lm_loss
from tests.models.mlp import mlp
from tests.reference import (
    ADAMW,
    ATOL,
    RTOL,
    SGD,
    assert_state_equal,
    eager_train,
    pipeline_train,
    token_batches,
)

ACT, STATE = 1000.0, 50.0  # bytes a 1F1B stage stashes per microbatch; its state (a V chunk: half of each)
_KINDS = {Phase.FORWARD: _ComputationType.FORWARD, Phase.INPUT_GRAD: _ComputationType.BACKWARD_INPUT,
          Phase.WEIGHT_GRAD: _ComputationType.BACKWARD_WEIGHT}


def _torch_order(p: int, m: int, rank: int) -> list[tuple]:
    """torch's ZB-V order of one rank (its schedule object built without stages: only the order is read)."""
    schedule = ScheduleZBVZeroBubble.__new__(ScheduleZBVZeroBubble)
    schedule.pp_group_size, schedule.num_stages, schedule._n_microbatches = p, 2 * p, m
    return [(a.computation_type, a.stage_index, a.microbatch_index)
            for a in schedule._calculate_single_rank_operations(rank) if a is not None]


@pytest.mark.parametrize(("p", "m"), [(2, 4), (3, 6), (4, 8), (4, 3), (2, 1)])
def test_order_is_torchs_zbv(p: int, m: int) -> None:
    """Every device's F, B, W order equals ScheduleZBVZeroBubble's (m < 2p - 1 too), its two updates last."""
    for d, tasks in enumerate(zb_v(p, m)):
        assert [(_KINDS[t.phase], t.stage, t.microbatch) for t in tasks[:-2]] == _torch_order(p, m, d)
        assert [(t.phase, t.stage) for t in tasks[-2:]] == [(Phase.UPDATE, d), (Phase.UPDATE, 2 * p - 1 - d)]


def test_each_stage_runs_its_passes_in_microbatch_order() -> None:
    """So each gradient is the float sum 1F1B makes (passes/schedule.py: one gradient order)."""
    for tasks in zb_v(3, 7):
        for stage in {t.stage for t in tasks}:
            for phase in (Phase.FORWARD, Phase.INPUT_GRAD, Phase.WEIGHT_GRAD):
                assert [t.microbatch for t in tasks if (t.stage, t.phase) == (stage, phase)] == list(range(7))


def _v_programs(p: int, m: int):
    stages, transfers = chain(2 * p)
    stages = tuple(dataclasses.replace(s, device=v_device(s.index, p)) for s in stages)
    return lower(stages, transfers, (), schedule_tasks("zb-v", 2 * p, m, p)[1], clip_grad_norm=False)


def _line_programs(schedule: str, p: int, m: int):
    stages, transfers = chain(p)
    return lower(stages, transfers, (), schedule_tasks(schedule, p, m)[1], clip_grad_norm=False)


def test_simulated_step_beats_zb_h1_and_1f1b_at_1f1bs_peak() -> None:
    """A balanced 4-device plan, M = 8, F = B = W, free links: 1F1B's step is 3(m + p - 1), ZB-H1's 3m + p - 1,
    and ZB-V's 8 half-size chunks leave only the first microbatch's way down the V and the last one's way back
    idle, p - 1 chunk forwards in all: 3m + (p - 1)/2. No device holds more than 1F1B's first stage."""
    p, m = 4, 8
    line = SimCost.uniform(p, 1.0, 2.0, stash_bytes=(ACT,) * p, state_bytes=(STATE,) * p)
    v = SimCost.uniform(2 * p, 0.5, 1.0, stash_bytes=(ACT / 2,) * (2 * p), state_bytes=(STATE / 2,) * (2 * p))
    flush, h1 = simulate(_line_programs("1f1b", p, m), line), simulate(_line_programs("zb-h1", p, m), line)
    zbv = simulate(_v_programs(p, m), v)
    assert flush.iteration_time == pytest.approx(3 * (m + p - 1)) and h1.iteration_time == pytest.approx(3 * m + p - 1)
    assert zbv.iteration_time == pytest.approx(3 * m + (p - 1) / 2)
    assert zbv.iteration_time < h1.iteration_time < flush.iteration_time
    assert max(zbv.peak_bytes.values()) <= max(flush.peak_bytes.values())


@pytest.fixture(scope="module")
def gpt_runs() -> dict:
    """TinyGPT (tied embedding and head, the second block frozen) under zb-v on 2 devices and under 1F1B
    on 4 devices with the same four stages, and eager training: losses and final states."""
    torch.manual_seed(3)
    model = TinyGPT()
    model.blocks[1].requires_grad_(False)
    batches = token_batches(steps=2)
    runs = {}
    for schedule, devices in (("zb-v", 2), ("1f1b", 4)):
        pipe = sw.compile(copy.deepcopy(model), devices, batches[0][0], loss_fn=lm_loss, example_target=batches[0][1],
                          optimizer=ADAMW, microbatches=4, schedule=schedule, cost="analytic", clip_grad_norm=0.5,
                          split_points=["blocks.1", "blocks.2", "blocks.3"])
        runs[schedule] = (torch.stack(pipeline_train(pipe, batches)), pipe.state_dict(), pipe)
    want = eager_train(model, batches, loss_fn=lm_loss, optimizer=ADAMW, microbatches=4, clip_grad_norm=0.5)
    runs["eager"] = (torch.stack(want), model.state_dict(), None)
    return runs


def test_trains_like_eager_and_bitwise_like_1f1b_on_the_same_split(gpt_runs: dict) -> None:
    """The tie (stages 0 and 3, both on device 0 in the V), a frozen block, AdamW and clipping."""
    (losses, state, pipe), (flush_losses, flush_state, _) = gpt_runs["zb-v"], gpt_runs["1f1b"]
    assert [s.device for s in pipe.plan.stages] == [0, 1, 1, 0]
    assert torch.equal(losses, flush_losses)
    assert all(torch.equal(state[name], flush_state[name]) for name in state)
    torch.testing.assert_close(losses, gpt_runs["eager"][0], rtol=RTOL, atol=ATOL)
    assert_state_equal(state, gpt_runs["eager"][1])
    assert "dev1: F0@s1 F0@s2 F1@s1 F1@s2 Bi0@s2 W0@s2 F2@s1 Bi0@s1" in str(pipe.plan)


def test_trains_like_eager_on_three_devices_with_swap() -> None:
    """6 stages on 3 devices (the V's turn on device 2 is a local transfer), every stage's state swapped."""
    torch.manual_seed(4)
    model, batches = TinyGPT(), token_batches(steps=2)
    pipe = sw.compile(copy.deepcopy(model), 3, batches[0][0], loss_fn=lm_loss, example_target=batches[0][1],
                      optimizer=SGD, microbatches=4, schedule="zb-v", swap="on", cost="analytic")
    assert [s.device for s in pipe.plan.stages] == [0, 1, 2, 2, 1, 0]
    losses = torch.stack(pipeline_train(pipe, batches))
    torch.testing.assert_close(losses, torch.stack(eager_train(model, batches, loss_fn=lm_loss, optimizer=SGD,
                                                               microbatches=4)), rtol=RTOL, atol=ATOL)
    assert_state_equal(pipe.state_dict(), model.state_dict())


@pytest.mark.parametrize(("options", "problem"), [
    ({}, "only 2 legal cut-points"),
    ({"replicas": 2}, "without data-parallel replicas"),
    ({"stages": 2}, "zb-v places its own"),
])
def test_refuses_what_it_cannot_run(options: dict, problem: str) -> None:
    """An MLP of 3 layers cannot make the 4 stages of a V on 2 devices: refused, naming zb-h1 and fewer
    devices; so are data-parallel replicas and a pipeline depth."""
    x, y = torch.randn(8, 8), torch.randint(0, 5, (8,))
    model = mlp(depth=2) if not options else mlp()
    with pytest.raises(sw.PartitionError, match=problem) as refused:
        sw.compile(model, 2 if not options else 4, (x,), loss_fn=F.cross_entropy, example_target=y, microbatches=4,
                   schedule="zb-v", cost="analytic", **options)
    assert options or "schedule='zb-h1'" in str(refused.value) and "1 devices or fewer" in str(refused.value)


# ---- the planner weighs them -----------------------------------------------------------------------
def _scored(schedule: str, m: int, seconds: float, fits: bool = True, **options) -> tuple[Candidate, Prediction]:
    return Candidate(sw.Schedule(schedule), m, **options), Prediction(seconds, (), (), fits)


def test_zero_bubble_candidates_come_from_the_fastest_fitting_1f1b_and_interleaved() -> None:
    """ZB-H1 on the fastest 1F1B that fits (its microbatches, replicas, depth), ZB-V at its count and the
    fastest fitting interleaved count; no ZB-V without 2N stages' cuts or where NCCL would refuse it."""
    tried = [_scored("gpipe", 4, 3.9), _scored("1f1b", 2, 5.0), _scored("1f1b", 4, 4.0, replicas=2, stages=1),
             _scored("1f1b", 8, 3.0, fits=False), _scored("interleaved", 4, 4.5), _scored("interleaved", 8, 4.2),
             (Candidate(sw.Schedule.INTERLEAVED, 2), "cannot split")]
    h1, v4, v8 = (Candidate(sw.Schedule.ZB_H1, 4, 2, 1), Candidate(sw.Schedule.ZB_V, 4), Candidate(sw.Schedule.ZB_V, 8))
    assert zero_bubble_candidates(tried, 2, legal_cuts=3, v_allowed=True) == [h1, v4, v8]
    assert zero_bubble_candidates(tried, 2, legal_cuts=2, v_allowed=True) == [h1]
    assert zero_bubble_candidates(tried, 2, legal_cuts=3, v_allowed=False) == [h1]
    replicated = [_scored("1f1b", 4, 4.0, stage_replicas=(2, 1))]
    assert zero_bubble_candidates(replicated, 3, legal_cuts=9, v_allowed=True) == [Candidate(sw.Schedule.ZB_V, 4)]
    assert zero_bubble_candidates([_scored("1f1b", 4, 4.0, fits=False)], 2, 9, True) == []


def test_the_second_round_rescores_only_the_first_rounds_plans_within_the_margin() -> None:
    """Any plan within the margin of a faster zero-bubble plan is within it of the first round's fastest."""
    dp = Candidate(sw.Schedule.ONE_F_ONE_B, 4, dp_replication=True)
    tried = [_scored("gpipe", 4, 4.3), _scored("1f1b", 4, 4.5), _scored("1f1b", 2, 4.0, fits=False),
             _scored("interleaved", 4, 4.0), (replace(dp, stage_replicas=(2, 1)), Prediction(4.39, (), (), True)),
             (Candidate(sw.Schedule.INTERLEAVED, 2), "cannot split")]
    assert finalists(tried) == [Candidate(sw.Schedule.GPIPE, 4), Candidate(sw.Schedule.INTERLEAVED, 4), dp]


def test_auto_weighs_zb_h1_and_zb_v_beside_the_others_on_gpus() -> None:
    """schedule="auto" for 2 GPUs (sw.plan: analytic, nothing run) scores them from the simulator like every
    candidate, and the table shows them."""
    torch.manual_seed(0)
    ids = torch.randint(0, 64, (8, 9))
    gpus = [sw.Device(f"cuda:{i}", memory="80GiB", peak_flops="989TFLOPS", memory_bandwidth="3.35TB/s") for i in (0, 1)]
    plan = sw.plan(TinyGPT(), gpus, (ids[:, :-1],), loss_fn=lm_loss, example_target=ids[:, 1:], microbatches=2)
    rows = {" ".join(line.split()[:2]): line for line in plan.considered}
    assert {"gpipe x2", "1f1b x2", "interleaved x2", "zb-h1 x2", "zb-v x2"} == set(rows)
    assert all("ms/iteration, fits" in line for line in rows.values())


def test_auto_leaves_them_out_where_stages_run_their_backward_whole() -> None:
    """compile_stages and cuda_graphs run each backward whole, so a split plan would be refused
    (compiler/assembly/stage_acceleration.py)."""
    assert weighs_split_backward(whole_backward=False)
    assert not weighs_split_backward(whole_backward=True)


def test_the_split_backwards_own_time_lengthens_bi_and_w_in_their_shares() -> None:
    """What splitting a backward adds on this machine (SimCost.split_backward_s, per stage) is charged on its
    Bi and W in their shares of the backward: a ZB-H1 step of 2 stages grows by it, every split span with it."""
    p, m, extra = 2, 4, 0.5
    programs = _line_programs("zb-h1", p, m)
    shares = (0.0, 0.5)  # the first stage sends no gradient: its W does the whole backward
    plain = simulate(programs, SimCost.uniform(p, 1.0, 2.0, input_grad_share=shares))
    split = simulate(programs, SimCost.uniform(p, 1.0, 2.0, input_grad_share=shares, split_backward_s=(extra,) * p))

    def spans(result, kind: type) -> dict:
        return {(s.device, s.index): s.end - s.start for s in result.timeline if isinstance(s.instruction, kind)}

    for kind, share in ((InputGrad, shares), (WeightGrad, tuple(1 - x for x in shares))):
        grown = spans(split, kind)
        for (device, index), seconds in spans(plain, kind).items():
            assert grown[(device, index)] == pytest.approx(seconds + extra * share[device])
    assert split.iteration_time > plain.iteration_time


def test_auto_weighs_zero_bubble_on_cpus_with_the_splits_time_charged() -> None:
    """TinyGPT on 2 CPU devices: auto weighs zb-h1 and zb-v (left out on a CPU before), and charging the split's
    measured Python time it keeps gpipe, where zb-h1 measured 21.9 ms a step against gpipe's 15.5 ms
    (uncharged, the simulator put zb-h1 x1 at 3.22 ms, under gpipe's 3.62: auto would have taken it)."""
    torch.manual_seed(0)
    ids = torch.randint(0, 64, (8, 9))
    pipe = sw.compile(TinyGPT(), 2, (ids[:, :-1],), loss_fn=lm_loss, example_target=ids[:, 1:], cost="analytic")
    assert any(line.startswith("zb-h1") for line in pipe.plan.considered)
    assert pipe.plan.schedule not in (sw.Schedule.ZB_H1, sw.Schedule.ZB_V)
    blocks = [i for i, layer in enumerate(pipe.plan.layers) if layer.name.startswith("blocks.")]
    assert blocks and all(pipe.plan.costs.runtime.split_backward_s[i] > 0 for i in blocks)
