"""Stashed activations swapped to host memory (Harmony's sX, Table 3): a stage's stash leaves the
device after each forward and comes back before that microbatch's backward; training still equals
eager training, the swapped bytes are the stash the pool counted, and a model whose stashes in
flight do not fit trains within capacity because of it."""

from dataclasses import replace

import pytest
import torch

import stagewise as sw
from stagewise.ir.instructions import Backward, Carried, Forward, Send, StashIn, StashOut
from stagewise.ir.plan import Layer, Stage, Transfer
from stagewise.passes.lower import lower
from stagewise.passes.schedule import schedule_tasks
from stagewise.passes.simulate import SimCost, simulate
from stagewise.passes.swap import SwapPlan, plan_swaps
from tests.hf import gpt2, lm_batches
from tests.models.gpt import TinyGPT, lm_loss
from tests.reference import ADAMW, check_equal_training, pipeline_train, token_batches


def stash_swaps(pipe, kind: type = StashOut) -> list:
    return [(p.device, i) for p in pipe.programs for i in p.instructions if isinstance(i, kind)]


def swapped_microbatches(pipe) -> dict[int, list[int]]:
    """Per stage, the microbatches whose stash the programs send to host memory."""
    found: dict[int, list[int]] = {}
    for _, ins in stash_swaps(pipe):
        found.setdefault(ins.stage, []).append(ins.microbatch)
    return found


def stash_bytes(pipe) -> dict[int, int]:
    """What one microbatch of each stage stashes, as its pool counted it (equal for every microbatch of
    the example's sizes, the only ones these tests give)."""
    sizes = {}
    for worker in pipe._workers:
        sizes[worker.stage.index] = max(v for (grad, _), v in worker.stash_size.items() if grad)
    return sizes


def _find(code, kind: type, key: tuple, carries: Carried | None = None) -> list[int]:
    return [j for j, c in enumerate(code) if isinstance(c, kind) and (c.stage, getattr(c, "microbatch", None)) == key
            and (carries is None or c.carries is carries)]


def assert_stash_program_order(pipe) -> None:
    """The swap-out of a stash waits for its forward and the sends of its outputs, its swap-in for
    that swap-out (or a later instruction of its stream: a stream runs in order), and the
    microbatch's backward for the swap-in."""
    for program in pipe.programs:
        code = program.instructions
        for index, ins in enumerate(code):
            if not isinstance(ins, (StashIn, StashOut)):
                continue
            key = (ins.stage, ins.microbatch)
            if isinstance(ins, StashOut):
                (forward,) = _find(code, Forward, key)
                sends = _find(code, Send, key, carries=Carried.ACTIVATIONS)
                assert forward < index and forward in ins.waits
                assert not sends or (max(sends) < index and max(sends) in ins.waits)
            else:
                (out,) = _find(code, StashOut, key)
                (backward,) = _find(code, Backward, key)
                assert out < index < backward and index in code[backward].waits
                assert any(out <= w and code[w].stream is code[out].stream for w in ins.waits)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "harmony-pp", "harmony-dp"])
def test_schedules_with_stash_swapping_train_like_eager(schedule):
    """swap="all": state swapped Harmony-style and every stage's stash to host memory between F and B."""
    steps, m = 3, 4
    pipe = check_equal_training(TinyGPT(layers=4), token_batches(steps=steps), 2, loss_fn=lm_loss, optimizer=ADAMW,
                                microbatches=m, schedule=schedule, swap="all")
    assert_stash_program_order(pipe)
    swapped, sizes = swapped_microbatches(pipe), stash_bytes(pipe)
    assert swapped and len(stash_swaps(pipe, StashIn)) == len(stash_swaps(pipe))
    # the swapped bytes are the stash the pool counted: nothing of it stays on the device
    moved = {d: 0 for d in range(2)}
    for stage in pipe.plan.stages:
        moved[stage.device] += len(swapped.get(stage.index, [])) * sizes[stage.index]
    assert sum(moved.values()) > 0
    for pool in pipe._runtime.pools:
        assert pool.swapped["stash"] == steps * 2 * moved[pool.index]  # out and back in, every step
        assert pool.by_kind["stash"] == 0
    if schedule == "1f1b":  # stage 0 swaps every microbatch; the last stage runs each B right after its F
        assert sorted(swapped) == [0] and sorted(swapped[0]) == list(range(m))
        assert pipe._runtime.pools[0].swapped["stash"] == steps * 2 * m * sizes[0]
    if schedule == "gpipe":  # every microbatch: the backwards run in microbatch order, none right after its forward
        assert {s: sorted(mbs) for s, mbs in swapped.items()} == {0: list(range(m)), 1: list(range(m))}
    pipe.simulate()


def test_hf_gpt2_with_stash_swapping():
    pipe = check_equal_training(gpt2(layers=4), lm_batches(), 2, optimizer=ADAMW, microbatches=4, schedule="1f1b",
                                swap="all")
    assert_stash_program_order(pipe)
    assert pipe._runtime.pools[0].swapped["stash"] == 3 * 2 * 4 * stash_bytes(pipe)[0] > 0
    pipe.simulate()


def _probe(model, batches, m):
    pipe = sw.compile(model, 2, batches[0][0], loss_fn=lm_loss, example_target=batches[0][1], optimizer=ADAMW,
                      microbatches=m, schedule="gpipe", split_points=["blocks.2"], swap="off")
    pipeline_train(pipe, batches[:1])
    state = [s["weights_bytes"] + s["optimizer_bytes"] + s["weights_bytes"] for s in pipe.stats]  # + gradients
    planned = pipe._sim_cost.stash_bytes
    stash = [max(sizes, planned[s]) for s, sizes in sorted(stash_bytes(pipe).items())]
    return state, stash


def test_stashes_in_flight_that_do_not_fit_train_within_capacity():
    """GPipe keeps all m stashes until the backward; the devices hold their stage's state and three
    microbatches' stashes, not eight. compile (swap="auto") swaps the stashes, not the state (asked to:
    by default the planner may recompute them instead, tests/test_activation_policy.py)."""
    model, batches, m = TinyGPT(layers=4), token_batches(), 8
    state, stash = _probe(model, batches, m)
    capacity = max(st + 3 * sx for st, sx in zip(state, stash, strict=True)) + 16 * 1024  # transfer buffers
    assert all(st + m * sx > capacity for st, sx in zip(state, stash, strict=True))
    devices = [sw.Device("cpu", memory=capacity) for _ in range(2)]
    kwargs = dict(loss_fn=lm_loss, optimizer=ADAMW, microbatches=m, schedule="gpipe", split_points=["blocks.2"])
    with pytest.raises(sw.CapacityError):
        pipe = sw.compile(model, devices, batches[0][0], example_target=batches[0][1], swap="off",
                          activations="keep", **kwargs)
        pipeline_train(pipe, batches[:2])  # the AdamW moments exist from the first update on
    pipe = check_equal_training(model, batches, devices, activations="swap", **kwargs)
    swapped = swapped_microbatches(pipe)
    assert sorted(swapped) == [0, 1] and all(sorted(mbs) == list(range(m)) for mbs in swapped.values())
    assert all(s["swap_weights_bytes"] == 0 for s in pipe.stats)  # the state stays: only stashes move
    for stats in pipe.stats:
        assert stats["peak_bytes"] <= capacity
    predicted = pipe.simulate().peak_bytes
    assert all(peak <= capacity for peak in predicted.values())
    assert all(peak <= capacity for peak in pipe.plan.predicted_peak_bytes)


def test_state_and_stashes_swapped_together_within_capacity():
    """Harmony PP with swap="auto" on devices that hold neither the model's state nor a pack's
    stashes in flight: both go to host memory."""
    model, batches = TinyGPT(layers=6, dim=64), token_batches(batch=16)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    capacity = 2 * weights  # half of weights + gradients + AdamW moments
    devices = [sw.Device("cpu", memory=capacity) for _ in range(2)]
    pipe = check_equal_training(model, batches, devices, loss_fn=lm_loss, optimizer=ADAMW, microbatches=8,
                                schedule="harmony-pp")
    assert stash_swaps(pipe)
    for stats in pipe.stats:
        assert stats["peak_bytes"] <= capacity and stats["swap_weights_bytes"] > 0
    assert all(peak <= capacity for peak in pipe.simulate().peak_bytes.values())


# ---- the plan, the programs and the simulator, on hand-made stages ---------------------------------
ACT, STATE = 1000.0, 50.0


def chain(p: int):
    stages = tuple(
        Stage(index=s, device=s, layers=(s,), inputs=("x",) if s == 0 else (f"h{s - 1}",),
              outputs=("loss",) if s == p - 1 else (f"h{s}",), params=(f"w{s}",), buffers=())
        for s in range(p)
    )
    transfers = tuple(Transfer(f"h{s}", s, s + 1, 4.0, True) for s in range(p - 1))
    layers = tuple(Layer(s, f"l{s}", (), (f"w{s}",), (), (), (), param_bytes=10) for s in range(p))
    return stages, transfers, layers


def simulated(schedule: str, p: int, m: int, swaps: SwapPlan):
    stages, transfers, _ = chain(p)
    _, tasks = schedule_tasks(schedule, p, m)
    programs = lower(stages, transfers, (), tasks, clip_grad_norm=False, swap=swaps)
    cost = SimCost.uniform(p, 1.0, 2.0, stash_bytes=(ACT,) * p, state_bytes=(STATE,) * p, host_bandwidth=ACT)
    return programs, simulate(programs, cost)


@pytest.mark.parametrize(("depth", "held"), [(2, 2), (1, 1)])
def test_simulated_gpipe_holds_depth_stashes_instead_of_m(depth, held):
    p, m = 2, 6
    _, kept = simulated("gpipe", p, m, SwapPlan())
    assert kept.peak_bytes[0] == STATE + m * ACT
    swaps = SwapPlan(stash=frozenset(range(p)), stash_bytes=dict.fromkeys(range(p), int(ACT)), stash_depth=depth)
    programs, result = simulated("gpipe", p, m, swaps)
    for d in range(p):
        assert result.peak_bytes[d] == STATE + held * ACT
        assert result.swap_out_bytes[d] == result.swap_in_bytes[d] == m * ACT  # B0 first: every stash goes out
        assert result.memory[d][-1][1] == STATE  # every stash released by the end
    # the copies overlap compute: a swap-in runs while the backward before it computes
    spans = {(s.device, s.index): s for s in result.timeline}
    code = programs[0].instructions
    swap_ins = [i for i, ins in enumerate(code) if isinstance(ins, StashIn)]
    backwards = [i for i, ins in enumerate(code) if isinstance(ins, Backward)]
    if depth == 2:
        assert any(spans[(0, i)].start < spans[(0, b)].end and spans[(0, b)].start < spans[(0, i)].end
                   for i in swap_ins for b in backwards)


def test_plan_swaps_chooses_stashes_only_where_they_do_not_fit():
    p, m = 2, 8
    stages, _, layers = chain(p)
    _, tasks = schedule_tasks("gpipe", p, m)
    stash = [100.0] * p
    state = 2 * 10  # weights + gradients per stage (SGD without momentum: no optimizer state)

    def plan(mode, capacity):
        return plan_swaps(mode, stages, layers, [capacity] * p, 2.0, tasks, stash)

    assert plan("auto", None).stash == frozenset()
    assert plan("auto", state + m * 100).stash == frozenset()  # every stash in flight fits
    assert plan("auto", state + m * 100 - 1).stash == frozenset(range(p))
    assert plan("auto", state + 250).stash_depth == 2 and plan("auto", state + 150).stash_depth == 1
    assert plan("off", 1).stash == frozenset() and plan("all", None).stash == frozenset(range(p))
    assert plan("on", None).stash == frozenset() and plan("on", None).stages == frozenset(range(p))
    with pytest.raises(sw.PlanError, match="swap="):
        plan("sometimes", None)


def test_a_backward_without_its_stash_is_an_error():
    """A program that sends a stash out and never brings it back fails clearly, it does not compute garbage."""
    ids = torch.randint(0, 64, (4, 9))
    pipe = sw.compile(TinyGPT(layers=2), 2, (ids[:, :-1],), loss_fn=lm_loss, example_target=ids[:, 1:], microbatches=2,
                      schedule="1f1b", swap="all")
    program = pipe.programs[0]
    kept = tuple(i for i in program.instructions if not isinstance(i, StashIn))
    index = {id(i): n for n, i in enumerate(kept)}
    renumber = {n: index[id(i)] for n, i in enumerate(program.instructions) if id(i) in index}
    kept = tuple(replace(i, waits=tuple(renumber[w] for w in i.waits if w in renumber)) for i in kept)
    pipe._executor.programs = (replace(program, instructions=kept),) + pipe._executor.programs[1:]
    pipe.timeout_s = 20
    with pytest.raises(sw.PlanError, match="stash-in"):
        pipe.step(ids[:, :-1], target=ids[:, 1:])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "harmony-pp"])
def test_stash_swapping_on_cuda_streams_trains_like_eager(schedule):
    """Pinned host buffers, the copies on the swap streams, the backward after its swap-in's event."""
    from tests.harness.cuda import check_on_gpu, gpus

    pipe = check_on_gpu(TinyGPT(layers=4), token_batches(), gpus(2), microbatches=4, schedule=schedule, swap="all")
    assert all(w.device.type == "cuda" for w in pipe._workers)
    assert sum(s["swap_stash_bytes"] for s in pipe.stats) > 0
    assert all(buffer.is_pinned() for w in pipe._workers for free in w.host_bytes.free.values() for buffer, _ in free)
