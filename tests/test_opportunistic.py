"""Varuna's opportunistic policy (§3.2): a forward that is ready runs ahead of a late gradient.

When a stage's next task is a recompute (or a backward) whose gradient has not arrived from the
next stage, the runtime and the simulator run the next forward first if it is ready. Only
forwards move, so training stays bitwise that of the static order, and equal to eager training.
The runtime tests make one stage's backward slow (a late gradient, as network jitter would); the
simulator tests give the gradient's link a low bandwidth.
"""

from __future__ import annotations

import copy
import datetime
import os
import pickle
import time
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import stagewise as sw
from stagewise.ir.instructions import Backward, Carried, Forward, Recompute, Recv, Send, Stream
from stagewise.passes.lower import lower
from stagewise.passes.schedule import schedule_tasks
from stagewise.passes.simulate import SimCost, simulate
from tests.harness.ranks import spawn
from tests.harness.stages import chain
from tests.models.gpt import TinyGPT, lm_loss
from tests.reference import ADAMW, ATOL, RTOL, assert_state_equal, eager_train, pipeline_train, token_batches

SLOW_BACKWARD_S = 0.1  # the last stage's backward sleeps this long: its gradients arrive late
MICROBATCH_COMPUTES = (Forward, Recompute, Backward)  # F, R, B: every compute but the update


def compute_order(timeline, program) -> list[str]:
    """The compute instructions a device ran, in the order they started ("F3", "R0", ...), updates left out."""
    runs = sorted((start, index) for device, _, index, start, _ in timeline if device == program.device)
    code = program.instructions
    return [f"{code[i].opcode}{code[i].microbatch}" for _, i in runs if isinstance(code[i], MICROBATCH_COMPUTES)]


def program_order(program) -> list[str]:
    return [f"{ins.opcode}{ins.microbatch}" for ins in program.instructions if isinstance(ins, MICROBATCH_COMPUTES)]


def overtaken(order: list[str], static: list[str]) -> list[tuple[str, str]]:
    """(forward, recompute or backward) pairs where the forward ran first but comes later in `static`."""
    ran = {task: i for i, task in enumerate(order)}
    return [(f, b) for i, b in enumerate(static) if b[0] in "RB" for f in static[i + 1 :]
            if f[0] == "F" and ran[f] < ran[b]]


def slow_last_backward(pipe) -> None:
    """The last stage's backward sleeps first: the gradient its predecessor needs comes late."""
    (worker,) = [w for w in pipe._workers if w.is_last]
    backward = worker.backward

    def slow(*args, **kwargs):
        time.sleep(SLOW_BACKWARD_S)
        return backward(*args, **kwargs)

    worker.backward = slow


def compile_gpt(model, batches, devices: int = 3):
    inputs, target = batches[0]
    return sw.compile(model, devices, inputs, loss_fn=lm_loss, example_target=target, optimizer=ADAMW,
                      microbatches=4, schedule="varuna", cost="analytic")


# ---- the runtime -------------------------------------------------------------------------------
def test_late_gradient_lets_a_ready_forward_run_first_and_training_is_unchanged():
    """With the last stage slow, the earlier stages run forwards ahead of recomputes whose gradient is
    late (device 1 receives those forwards' activations itself); the losses and weights are bitwise
    those of the static order, and equal eager training's."""
    model, batches = TinyGPT(), token_batches()
    static = compile_gpt(copy.deepcopy(model), batches)
    static._executor.state.opportunistic = False
    moved = compile_gpt(copy.deepcopy(model), batches)
    slow_last_backward(moved)
    assert moved.plan.schedule == "varuna" and len(moved.programs) == 3
    want = eager_train(model, batches, loss_fn=lm_loss, optimizer=ADAMW, microbatches=4)
    losses = {}
    for name, pipe in (("static", static), ("moved", moved)):
        losses[name] = pipeline_train(pipe, batches)
        torch.testing.assert_close(torch.stack(losses[name]), torch.stack(want), rtol=RTOL, atol=ATOL)
        assert_state_equal(pipe.state_dict(), model.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(losses["static"], losses["moved"], strict=True))
    static_state, moved_state = static.state_dict(), moved.state_dict()
    assert all(torch.equal(static_state[k], moved_state[k]) for k in static_state)

    for program in static.programs:  # switched off: every device in the static order
        assert compute_order(static._executor.state.step.timeline, program) == program_order(program)
    assert static._executor.state.step.deviations == []
    middle = moved.programs[1]
    order = compute_order(moved._executor.state.step.timeline, middle)
    assert order != program_order(middle)
    assert overtaken(order, program_order(middle)), order  # some F(k) ran before an R(m) or B(m) it follows in the schedule
    assert [b for b in order if b[0] == "B"] == [b for b in program_order(middle) if b[0] == "B"]
    for device, early, head in moved._executor.state.step.deviations:
        code = moved.programs[device].instructions
        assert isinstance(code[early], Forward) and isinstance(code[head], (Recompute, Backward))
    early_on_1 = [middle.instructions[e].microbatch for device, e, _ in moved._executor.state.step.deviations if device == 1]
    taken = [i for i, stream in moved._executor.state.step.owner[1].items() if stream is Stream.COMPUTE]  # in the last step
    assert early_on_1 and {middle.instructions[i].microbatch for i in taken if isinstance(middle.instructions[i], Recv)} \
        >= set(early_on_1)  # the compute thread received the early forwards' activations itself
    for s in moved.stats:
        assert s["stash_bytes"] == 0 and s["buffer_bytes"] == 0  # every stash and buffer released


def test_without_delay_training_equals_eager():
    """No stage held back: whatever the timing lets run early, training is eager's."""
    model, batches = TinyGPT(), token_batches()
    pipe = compile_gpt(copy.deepcopy(model), batches, devices=4)
    got = pipeline_train(pipe, batches)
    want = eager_train(model, batches, loss_fn=lm_loss, optimizer=ADAMW, microbatches=4)
    torch.testing.assert_close(torch.stack(got), torch.stack(want), rtol=RTOL, atol=ATOL)
    assert_state_equal(pipe.state_dict(), model.state_dict())


def test_no_forward_runs_early_where_the_pool_has_no_room_for_its_stash():
    """Each early forward holds one more stash: with the pool too full for one, the order is static."""
    model, batches = TinyGPT(), token_batches(steps=1)
    pipe = compile_gpt(model, batches)
    slow_last_backward(pipe)
    for pool in pipe._runtime.pools:
        pool.capacity = 1 << 40
    pipe._executor.varuna._note_stash = lambda ins: None
    pipe._executor.state.stash_bytes = {stage.index: 1 << 41 for stage in pipe.plan.stages}  # never fits
    pipeline_train(pipe, batches)
    assert pipe._executor.state.step.deviations == []
    for program in pipe.programs:
        assert compute_order(pipe._executor.state.step.timeline, program) == program_order(program)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_late_gradient_on_cuda_streams():
    """On CUDA the taken-over receives and sends run on the compute stream and record their events there."""
    torch.backends.cuda.matmul.allow_tf32 = False
    model, batches = TinyGPT(), token_batches()
    inputs, target = batches[0]
    devices = [f"cuda:{i % torch.cuda.device_count()}" for i in range(3)]
    pipe = sw.compile(copy.deepcopy(model), devices, inputs, loss_fn=lm_loss, example_target=target, optimizer=ADAMW,
                      microbatches=4, schedule="varuna", cost="analytic")
    slow_last_backward(pipe)
    got = torch.stack([loss.cpu() for loss in pipeline_train(pipe, batches)])
    want = torch.stack(eager_train(model, batches, loss_fn=lm_loss, optimizer=ADAMW, microbatches=4))
    torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)
    assert_state_equal({k: v.cpu() for k, v in pipe.state_dict().items()}, model.state_dict())
    assert any(device == 1 for device, _, _ in pipe._executor.state.step.deviations)


# ---- the simulator -----------------------------------------------------------------------------
def varuna_programs(p: int, m: int):
    stages, transfers = chain(p)
    _, tasks = schedule_tasks("varuna", p, m)
    return lower(stages, transfers, (), tasks, clip_grad_norm=False)


def simulated_order(result, device: int) -> list[str]:
    return [f"{s.instruction.opcode}{s.instruction.microbatch}" for s in result.timeline
            if s.device == device and isinstance(s.instruction, MICROBATCH_COMPUTES)]


def test_simulator_runs_a_ready_forward_while_a_gradient_crosses_a_slow_link():
    """3 stages, 4 microbatches; the gradients from stage 2 to stage 1 take 2 s, the rest is free.
    Stage 1 runs F3 while the gradient of microbatch 0 is on its way, instead of after B2."""
    programs = varuna_programs(3, 4)
    cost = SimCost.uniform(3, 1.0, 2.0, value_bytes={"h0": 100.0, "h1": 100.0}, links={(2, 1): 50.0})
    static = simulate(programs, cost, opportunistic=False)
    moved = simulate(programs, cost)
    assert moved.iteration_time < static.iteration_time
    assert simulated_order(static, 1) == program_order(programs[1])
    assert simulated_order(moved, 1) == ["F0", "F1", "F2", "F3", "R0", "B0", "R1", "B1", "R2", "B2", "R3", "B3"]
    for d in range(3):  # only forwards move; every instruction ran once
        assert [b for b in simulated_order(moved, d) if b[0] != "F"] == [
            b for b in program_order(programs[d]) if b[0] != "F"]
        assert sorted(s.index for s in moved.timeline if s.device == d) == list(range(len(programs[d].instructions)))
    early = next(s for s in moved.timeline if s.device == 1 and isinstance(s.instruction, Forward)
                 and s.instruction.microbatch == 3)
    send = next(s for s in moved.timeline if s.device == 1 and isinstance(s.instruction, Send)
                and s.instruction.carries is Carried.ACTIVATIONS and s.instruction.microbatch == 3)
    grad0 = next(s for s in moved.timeline if s.device == 1 and isinstance(s.instruction, Send)
                 and s.instruction.carries is Carried.GRADIENTS and s.instruction.microbatch == 0)
    assert send.start == pytest.approx(early.end) and send.start < grad0.start  # not behind the gradient sends


def test_simulator_without_recompute_keeps_the_static_order():
    """The policy applies to programs that recompute (Varuna's); 1F1B's are played as they are."""
    stages, transfers = chain(3)
    _, tasks = schedule_tasks("1f1b", 3, 4)
    programs = lower(stages, transfers, (), tasks, clip_grad_norm=False)
    cost = SimCost.uniform(3, 1.0, 2.0, value_bytes={"h0": 100.0, "h1": 100.0}, links={(2, 1): 50.0})
    assert simulate(programs, cost).timeline == simulate(programs, cost, opportunistic=False).timeline


# ---- torch.distributed (gloo): three ranks, the middle one takes receives over -------------------
RANKS = 3
SPAWN_LIMIT_S = 120.0


def _rank(rank: int, init_file: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=RANKS,
                            timeout=datetime.timedelta(seconds=30))
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model, batches = TinyGPT(), token_batches()
    path = Path(out) / f"rank{rank}.pkl"
    try:
        pipe = compile_gpt(model, batches, devices=RANKS)
        pipe.timeout_s = 30.0
        if rank == RANKS - 1:
            slow_last_backward(pipe)
        losses = pipeline_train(pipe, batches)
        (program,) = pipe._executor.programs
        result = {"losses": losses, "state": {k: v.clone() for k, v in pipe.state_dict().items()},
                  "order": compute_order(pipe._executor.state.step.timeline, program), "static": program_order(program),
                  "deviations": pipe._executor.state.step.deviations, "stats": pipe.stats[rank]}
    except Exception:  # noqa: BLE001 - the parent shows it
        result = {"error": traceback.format_exc()}
        path.write_bytes(pickle.dumps(result))
        os._exit(0)
    path.write_bytes(pickle.dumps(result))
    dist.destroy_process_group()


def test_three_gloo_ranks_run_ready_forwards_early_and_train_like_eager(tmp_path):
    results = spawn(_rank, tmp_path, ranks=RANKS, limit_s=SPAWN_LIMIT_S)
    for rank, result in enumerate(results):
        assert result is not None and "error" not in result, f"rank {rank} failed:\n{result}"
    torch.manual_seed(0)
    model, batches = TinyGPT(), token_batches()
    want = eager_train(model, batches, loss_fn=lm_loss, optimizer=ADAMW, microbatches=4)
    for result in results:
        torch.testing.assert_close(torch.stack(result["losses"]), torch.stack(want), rtol=RTOL, atol=ATOL)
        assert_state_equal(result["state"], model.state_dict())
        assert result["stats"]["buffer_bytes"] == 0
    middle = results[1]
    assert middle["deviations"] and overtaken(middle["order"], middle["static"]), middle["order"]
    assert [b for b in middle["order"] if b[0] == "B"] == [b for b in middle["static"] if b[0] == "B"]
