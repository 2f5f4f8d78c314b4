"""Zero bubble (issue 25): the backward split into B (input gradient) and W (weight gradient) gives one
backward's gradients bit for bit, and ZB-H1 (Qi et al., ICLR 2024, §2.1) keeps 1F1B's memory with a third
of its bubble and trains like eager (and bitwise like 1F1B on the same split)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import stagewise as sw
from stagewise.ir.errors import PlanError
from stagewise.ir.instructions import InputGrad, WeightGrad
from stagewise.ir.program import programs_from_text, validate
from stagewise.passes.lower import lower
from stagewise.passes.schedule import schedule_tasks, zb_h1
from stagewise.passes.simulate import SimCost, simulate
from stagewise.runtime.split_backward import input_grads
from tests.harness.stages import chain
from tests.models.gpt import TinyGPT, lm_loss
from tests.models.mlp import mlp
from tests.reference import (
    ADAMW,
    ATOL,
    RTOL,
    SGD,
    assert_state_equal,
    check_equal_training,
    eager_train,
    pipeline_train,
    token_batches,
)

ACT, STATE = 1000.0, 50.0  # bytes one stage stashes per microbatch; its state


def _names(tasks) -> list[str]:
    """One stage's tasks as the paper's figures write them: microbatches counted from 1."""
    return [t.phase.value.rstrip("i") + ("" if t.microbatch is None else str(t.microbatch + 1)) for t in tasks]


# ---- the schedule --------------------------------------------------------------------------------
def test_zb_h1_is_the_papers_p4_schedule() -> None:
    """Qi et al. §2.1, Fig. 3 (top), p = 4, m = 8: 1F1B's warm-up; worker i holds back its first i W
    passes (every worker then has p microbatches in flight) and runs them in the cool-down."""
    assert [" ".join(_names(stage)) for stage in zb_h1(4, 8)] == [
        "F1 F2 F3 F4 B1 W1 F5 B2 W2 F6 B3 W3 F7 B4 W4 F8 B5 W5 B6 W6 B7 W7 B8 W8 U",
        "F1 F2 F3 B1 F4 B2 W1 F5 B3 W2 F6 B4 W3 F7 B5 W4 F8 B6 W5 B7 W6 B8 W7 W8 U",
        "F1 F2 B1 F3 B2 F4 B3 W1 F5 B4 W2 F6 B5 W3 F7 B6 W4 F8 B7 W5 B8 W6 W7 W8 U",
        "F1 B1 F2 B2 F3 B3 F4 B4 W1 F5 B5 W2 F6 B6 W3 F7 B7 W4 F8 B8 W5 W6 W7 W8 U",
    ]


def _programs(schedule: str, p: int, m: int):
    stages, transfers = chain(p)
    return lower(stages, transfers, (), schedule_tasks(schedule, p, m)[1], clip_grad_norm=False)


@pytest.mark.parametrize(("p", "m"), [(4, 8), (2, 4), (3, 6), (4, 16)])
def test_simulated_bubble_is_a_third_of_1f1b(p: int, m: int) -> None:
    """Equal stages, F = B = W (a backward of 2, split in halves), free links: ZB-H1's step is
    3m + (p - 1), a bubble of (p - 1)/3m (§2.1), where 1F1B's is (p - 1)/m; its peak stash is 1F1B's
    (p microbatches on the first stage; each later stage at most p too)."""
    cost = SimCost.uniform(p, 1.0, 2.0, stash_bytes=(ACT,) * p, state_bytes=(STATE,) * p)
    zb, flush = simulate(_programs("zb-h1", p, m), cost), simulate(_programs("1f1b", p, m), cost)
    assert zb.iteration_time == pytest.approx(3 * m + p - 1)
    assert flush.iteration_time == pytest.approx(3 * (m + p - 1)) and zb.iteration_time < flush.iteration_time
    assert zb.bubble_fraction == pytest.approx((p - 1) / (3 * m))
    assert max(zb.peak_bytes.values()) == max(flush.peak_bytes.values()) == STATE + min(p, m) * ACT
    assert all(peak <= STATE + min(p, m) * ACT for peak in zb.peak_bytes.values())


def test_the_gradients_b_records_for_w_are_held_until_w() -> None:
    """2 stages, 4 microbatches: stage 1 runs F0 Bi0 F1 Bi1 W0 F2 Bi2 W1 ..., so it holds two stashes and
    the gradients two Bi recorded at once; stage 0 records none (its W runs the whole backward)."""
    recorded = 300.0
    cost = SimCost.uniform(2, 1.0, 2.0, stash_bytes=(ACT,) * 2, state_bytes=(STATE,) * 2, recorded_bytes=(0.0, recorded))
    result = simulate(_programs("zb-h1", 2, 4), cost)
    assert result.peak_bytes == {0: STATE + 2 * ACT, 1: STATE + 2 * ACT + 2 * recorded}
    assert result.memory[1][-1][1] == STATE  # all of it released by the end of the step


def test_halves_pair_up_in_every_program() -> None:
    """A W without its B, a second B before the first's W, or an update before a W is refused."""
    body = ["compute  F stage=0 mb=0", "compute  Bi stage=0 mb=0", "compute  W stage=0 mb=0", "compute  U stage=0"]
    validate(programs_from_text("program dev0 (4 instructions)\n" + "\n".join(f"    {i}  {line}" for i, line in enumerate(body))))
    for bad, problem in [([0, 2, 3], "no input gradient"), ([0, 1, 3], "before their weight gradients"),
                         ([0, 1, 1, 2, 3], "a second input gradient")]:
        lines = [body[i] for i in bad]
        text = f"program dev0 ({len(lines)} instructions)\n" + "\n".join(f"    {i}  {line}" for i, line in enumerate(lines))
        with pytest.raises(PlanError, match=problem):
            validate(programs_from_text(text))


# ---- the split backward ----------------------------------------------------------------------------
class _Odd(torch.nn.Module):
    """A weight used twice (in a layer and directly), an output that depends on no input, and two
    weights that autograd hands one gradient tensor (added as they are: the same tensor for both)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm, self.up, self.down = torch.nn.LayerNorm(8), torch.nn.Linear(8, 16), torch.nn.Linear(16, 8)
        self.scale, self.table = torch.nn.Parameter(torch.randn(8)), torch.nn.Parameter(torch.randn(3, 8))
        self.shift, self.tilt = torch.nn.Parameter(torch.randn(4, 8)), torch.nn.Parameter(torch.randn(4, 8))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        h = x + self.down(torch.relu(self.up(self.norm(x)))) * self.scale
        return h + self.shift + self.tilt, self.up.weight.sum() * 0.1 + h.mean(), self.table * 2


@pytest.mark.parametrize("input_grad", [True, False])
def test_split_backward_gives_one_backwards_gradients_bitwise(input_grad: bool) -> None:
    """Two microbatches accumulated: B then W per microbatch equals one backward each, bit for bit, for
    the inputs and every weight (without an input gradient, as on a first stage, W does it all)."""
    torch.manual_seed(0)
    model = _Odd()
    xs = [torch.randn(4, 8) for _ in range(2)]

    def train(split: bool) -> list[torch.Tensor]:
        copy_ = copy.deepcopy(model)
        got = []
        for x in xs:
            x = x.clone().requires_grad_(input_grad)
            outputs = copy_(x)
            seeds = [torch.full_like(t, 0.3) for t in outputs]
            if split:
                found, weights = input_grads(list(outputs), seeds, [x] if input_grad else [], list(copy_.parameters()))
                weights.run()
                got += found
            else:
                torch.autograd.backward(list(outputs), seeds)
                got += [x.grad] if input_grad else []
        return got + [p.grad for p in copy_.parameters()]

    whole, halves = train(False), train(True)
    assert len(whole) == len(halves) and all(torch.equal(a, b) for a, b in zip(whole, halves, strict=True))


# ---- training --------------------------------------------------------------------------------------
def test_zb_h1_trains_like_eager_with_swap_and_clipping() -> None:
    """2 devices, tied embedding and head, AdamW, clipping (its global norm all-reduced after every W,
    before the update, as under the other schedules) and every stage's state swapped."""
    pipe = check_equal_training(TinyGPT(), token_batches(), 2, loss_fn=lm_loss, optimizer=ADAMW, microbatches=4,
                                clip_grad_norm=0.5, schedule="zb-h1", swap="on", cost="analytic")
    assert pipe._workers[1].recorded_bytes > 0 == pipe._workers[0].recorded_bytes  # counted in the pool till W
    kinds = {type(ins) for program in pipe.plan.programs for ins in program.instructions}
    assert {InputGrad, WeightGrad} <= kinds
    assert "weight gradient (W)" in str(pipe.plan) and "dev1: F0 Bi0 F1 Bi1" in str(pipe.plan)


def test_zb_h1_is_1f1b_bitwise_on_three_devices_with_frozen_weights() -> None:
    """3 devices, the tie and a frozen block: the same split under 1F1B gives the same losses and
    parameters bit for bit (each gradient the same float sum), and both train like eager."""
    torch.manual_seed(1)
    model = TinyGPT()
    model.blocks[1].requires_grad_(False)
    batches = token_batches(steps=2)
    states, losses = [], []
    for schedule in ("1f1b", "zb-h1"):
        pipe = sw.compile(copy.deepcopy(model), 3, batches[0][0], loss_fn=lm_loss, example_target=batches[0][1],
                          optimizer=SGD, microbatches=4, schedule=schedule, cost="analytic",
                          split_points=["blocks.1", "blocks.3"])
        losses.append(torch.stack(pipeline_train(pipe, batches)))
        states.append(pipe.state_dict())
    assert torch.equal(losses[0], losses[1])
    assert all(torch.equal(states[0][name], states[1][name]) for name in states[0])
    want = torch.stack(eager_train(model, batches, loss_fn=lm_loss, optimizer=SGD, microbatches=4))
    torch.testing.assert_close(losses[1], want, rtol=RTOL, atol=ATOL)
    assert_state_equal(states[1], model.state_dict())


def test_a_step_failing_between_b_and_w_leaves_nothing_behind(monkeypatch) -> None:
    """A W that raises: the step is rolled back, no microbatch's weight pass (and the autograd graph
    and stash it holds) stays on a worker, and the step then runs again as eager training's."""
    torch.manual_seed(2)
    model, x, y = mlp(), torch.randn(8, 8), torch.randint(0, 5, (8,))
    pipe = sw.compile(copy.deepcopy(model), 2, (x,), loss_fn=F.cross_entropy, example_target=y, optimizer=SGD,
                      microbatches=4, schedule="zb-h1", cost="analytic")
    before = {name: tensor.clone() for name, tensor in pipe.state_dict().items()}
    worker, calls = pipe._workers[1], []
    real = worker.backward_weight

    def failing(microbatch: int, instruction: str) -> None:
        calls.append(microbatch)
        if len(calls) == 2:
            raise RuntimeError("injected weight-gradient failure")
        real(microbatch, instruction)

    monkeypatch.setattr(worker, "backward_weight", failing)
    with pytest.raises(RuntimeError, match="injected weight-gradient failure"):
        pipe.step(x, target=y)
    assert all(not w.weight_passes for w in pipe._workers)
    assert_state_equal(pipe.state_dict(), before)
    monkeypatch.undo()
    got = pipe.step(x, target=y)
    want = eager_train(model, [((x,), y)], loss_fn=F.cross_entropy, microbatches=4)
    torch.testing.assert_close(got, want[0], rtol=RTOL, atol=ATOL)
    assert_state_equal(pipe.state_dict(), model.state_dict())
