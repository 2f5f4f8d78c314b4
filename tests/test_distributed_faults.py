"""Atomic steps under torch.distributed: a step that raises on one gloo rank is undone on both.

The failing rank posts a failure notice so its peer stops waiting at once, both ranks agree on
the failure in the step's closing all-reduce (the failing rank re-raises its own exception, the
other raises StepFailedError naming it), then drain what the failed step left in flight: every
posted receive gets a message, every issued send a receive, every half-entered all-reduce its
missing members. The next step then starts clean on both ranks.

First the pieces, driven directly on the transport of a compiled pipeline; then the whole step:
an exception injected in forward, backward, recompute and update, at several microbatch
positions, on rank 0 and on rank 1, under every schedule (the tied GPT: its shared gradients are
all-reduced across the ranks; some cases clip, which all-reduces the gradient norm). After each
failed step the state on both ranks equals the state before it, and training on equals eager
training that never saw the failed batch. Every step runs with a 20 s timeout: a regression
fails fast instead of hanging (a wait that expired is a PeerError, not the expected errors). One
pair of processes runs every case (spawning costs seconds): per schedule one pipeline takes a good
step, then per fault a failed step and a good one.
"""

from __future__ import annotations

import functools
import os
import traceback
from pathlib import Path

import pytest
import torch

import stagewise as sw
from stagewise.runtime.failure_notice import PeerFailed
from stagewise.runtime.step_records import missing_sides
from stagewise.runtime.sync import Aborted, Sync
from tests.harness.checkpoints import optimizer_state
from tests.harness.ranks import RANKS, join, save_result, spawn
from tests.models.gpt import TinyGPT, lm_loss
from tests.reference import ADAMW, ATOL, RTOL, assert_state_equal, eager_train, pipeline_train, token_batches

TIMEOUT_S = 20.0


class InjectedFault(RuntimeError):
    """The exception a test makes a stage raise."""


def _problem(clip: bool, steps: int):
    """(model, good batches, options) from seed 0, alike in every process (the tied GPT)."""
    torch.manual_seed(0)
    clipping = {"clip_grad_norm": 0.5} if clip else {}
    return TinyGPT(), token_batches(steps), {"loss_fn": lm_loss, "optimizer": ADAMW, "microbatches": 4, **clipping}


@functools.cache
def _eager(clip: bool, steps: int) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    model, batches, options = _problem(clip, steps)
    return eager_train(model, batches, **options), model.state_dict()


# ---- which operations a rank must add after a failure (no processes) ----------------------------
def _summary(sent=(), posted=(), collectives=()) -> dict:
    return {"sent": [list(s) for s in sent], "posted": [list(p) for p in posted],
            "collectives": [[list(g), [list(c) for c in done]] for g, done in collectives]}


def test_missing_sides_match_every_half_done_operation_and_nothing_else():
    """Rank 0 sent tags 1, 2, 3 to rank 1, which posted 1, 2 and 7; rank 0 entered two all-reduces of
    group (0, 1), rank 1 one: rank 1 receives 3 into scratch and enters the second all-reduce, rank 0
    sends a placeholder for 7. Matched operations are left alone."""
    summaries = [_summary(sent=[(1, [1, 2, 3])], collectives=[((0, 1), [(5, "float32"), (1, "float32")])]),
                 _summary(posted=[(0, [1, 2, 7])], collectives=[((0, 1), [(5, "float32")])])]
    rank0, rank1 = missing_sides(summaries, 0), missing_sides(summaries, 1)
    assert (rank0.placeholders, rank0.scratch, rank0.reductions) == ([(1, 7)], [], [])
    assert (rank1.placeholders, rank1.scratch, rank1.reductions) == ([], [(0, 3)], [((0, 1), 1, "float32")])


def test_missing_sides_of_a_clean_step_are_empty():
    summaries = [_summary(sent=[(1, [4, 5])], posted=[(1, [6])], collectives=[((0, 1), [(3, "float64")])]),
                 _summary(sent=[(0, [6])], posted=[(0, [5, 4])], collectives=[((0, 1), [(3, "float64")])])]
    for rank in range(RANKS):
        sides = missing_sides(summaries, rank)
        assert sides.placeholders == sides.scratch == sides.reductions == []


# ---- the transport's pieces between two ranks --------------------------------------------------
def _transport_pieces(rank: int, init_file: str, out: str) -> None:
    """Rank 0 sends two activations (rank 1 takes one), then enters the shared-gradient all-reduce
    alone; rank 1 posts a receive rank 0 never sends to, then fails and notifies. Rank 0 must stop
    on the notice, both must agree and drain, and then train like eager training."""
    join(init_file, rank, 30.0)
    torch.set_num_threads(1)
    result: dict = {}
    try:
        model, batches, options = _problem(False, 3)
        inputs, target = batches[0]
        pipe = sw.compile(model, RANKS, inputs, example_target=target, schedule="gpipe", cost="analytic",
                          swap="off", **options)
        pipe.timeout_s = TIMEOUT_S
        transport, pool = pipe._runtime.transport, pipe._runtime.pools[rank]
        transport.sync = Sync(1, 2 * TIMEOUT_S)
        transfer = next(t for t in pipe.plan.transfers if t.src == 0 and t.dst == 1)
        act = [("act", transfer.value, mb, 0, 1) for mb in range(pipe.plan.microbatches)]
        before = pool.stats()["buffer_bytes"]
        if rank == 0:
            for key in act[:2]:
                transport.send(key, 0, 1, torch.ones(transfer.shape), "test send")
            try:
                transport.all_reduce(("t",), (0, 1), 0, [torch.ones(5)], "test all-reduce")
                result["stopped"] = "not at all"
            except Aborted:
                result["stopped"] = type(transport.sync.error).__name__
            failed = transport.sync.error
        else:
            pool.give_back_buffer(transport.recv(act[0], "test receive"), ("buffer",) + act[0])
            assert transport.poll(act[2], "test poll") is False  # posted: rank 0 never sends it
            failed = InjectedFault("rank 1 failed on purpose")
            transport.notify_failure(failed)
        outcome = transport.conclude(None, failed)
        result["outcome"] = (outcome.loss, outcome.failure)
        transport.drain()
        result["epoch"] = transport.epoch
        result["leftover"] = (len(transport.receives), transport.records.summary())
        result["buffer_bytes"] = (before, pool.stats()["buffer_bytes"])
        transport.sync = None
        result["losses"] = pipeline_train(pipe, batches)
        result["state"] = {k: v.clone() for k, v in pipe.state_dict().items()}
    except Exception:  # noqa: BLE001 - the parent shows it
        result["error"] = traceback.format_exc()
    save_result(Path(out) / f"rank{rank}.pkl", result)
    os._exit(0)


def test_notice_conclude_and_drain_leave_both_ranks_clean(tmp_path):
    results = spawn(_transport_pieces, tmp_path)
    for rank, result in enumerate(results):
        assert result is not None and "error" not in result, (rank, result)
    assert results[0]["stopped"] == PeerFailed.__name__  # the notice stopped rank 0, not its timeout (a PeerError)
    for result in results:
        loss, failure = result["outcome"]
        assert loss is None and failure == "rank 1 failed: InjectedFault: rank 1 failed on purpose"
        assert result["epoch"] == 1
        assert result["leftover"] == (0, {"sent": [], "posted": [], "collectives": []})
        before, after = result["buffer_bytes"]
        assert before == after == 0
    want, state = _eager(False, 3)
    for result in results:
        torch.testing.assert_close(torch.stack(result["losses"]), torch.stack(want), rtol=RTOL, atol=ATOL)
        assert_state_equal(result["state"], state)


# ---- whole steps that fail, on every schedule ------------------------------------------------
SCHEDULES = ("gpipe", "1f1b", "interleaved", "varuna", "harmony-pp", "harmony-dp")
# (kind, rank, stage, position): `stage` is the rank's first or last stage (two per rank under the
# interleaved and Harmony schedules), `position` the microbatch among those the stage runs (first,
# middle, last). Recompute exists only under Varuna, on rank 0.
FAULTS = (("forward", 0, "first", "first"), ("forward", 1, "last", "last"), ("backward", 1, "first", "first"),
          ("backward", 0, "last", "middle"), ("update", 1, "last", None), ("update", 0, "first", None))
RECOMPUTE_FAULTS = (("recompute", 0, "first", "first"), ("recompute", 0, "first", "last"))
CLIPPED = ("gpipe", "varuna", "harmony-pp")  # these clip: the gradient-norm all-reduce is in flight too
# inputs one rank refuses (a target of another dtype): the step fails on both ranks at once
INPUT_FAULTS = (("input", 1, "first", None),)
PREDICT_FAULTS = (("predict-input", 1, "first", None),)  # pipe.predict the same way (it trains nothing)
CASES = {schedule: FAULTS + INPUT_FAULTS + (RECOMPUTE_FAULTS if schedule == "varuna" else ())
         + (PREDICT_FAULTS if schedule == "gpipe" else ()) for schedule in SCHEDULES}
CASES_LIMIT_S = 240.0  # every case on one pair of ranks (about 40 s on an idle 2-core machine)


def _inject(pipe, kind: str, stage: str, position: str | None):
    """Make one call of a local stage's forward, recompute, backward or update raise; returns the undo."""
    workers = sorted(pipe._workers, key=lambda w: w.stage.index)
    worker = workers[0 if stage == "first" else -1]
    microbatches = sorted(worker.stage.microbatches or range(pipe.plan.microbatches))
    target = microbatches[{"first": 0, "middle": len(microbatches) // 2, "last": -1}[position]] if position else None
    method = "forward" if kind == "recompute" else kind
    original = getattr(worker, method)
    opcode = {"forward": "F", "recompute": "R"}.get(kind)

    def failing(*args, **kwargs):
        label = args[-1] if kind == "backward" else (args[0] if kind == "update" else args[1])
        if target is None or (args[0] == target and (opcode is None or label.split()[3] == opcode)):
            raise InjectedFault(f"{kind} of stage {worker.stage.index} failed on purpose")
        return original(*args, **kwargs)

    setattr(worker, method, failing)
    return lambda: delattr(worker, method)


def _local_state(pipe) -> dict:
    """What this rank holds: weights, buffers, gradients, optimizer state, pool bytes."""
    found: dict = {("pool", "current"): pipe.stats[pipe.context.rank]["current_bytes"]}
    for worker in pipe._workers:
        for name, tensor in worker.module.state_dict().items():
            found[(worker.stage.index, name)] = tensor.detach().clone()
        for name, param in worker.params.items():
            found[(worker.stage.index, name, "grad")] = None if param.grad is None else param.grad.clone()
    found.update({key: value.clone() for key, value in optimizer_state(pipe).items()})
    return found


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and torch.equal(a, b)
    return a == b


def _failed_step(pipe, rank: int, fault: tuple, bad: tuple) -> dict:
    """One step with `fault` injected on its rank: what this rank raised and
    what of this rank's state differs after it from before."""
    kind, failing_rank, stage, position = fault
    before = _local_state(pipe)
    inputs, target = bad
    restore = None
    if rank == failing_rank and kind == "input":
        target = target.float()
    elif rank == failing_rank and kind == "predict-input":
        inputs = tuple(x.float() for x in inputs)
    elif rank == failing_rank:
        restore = _inject(pipe, kind, stage, position)
    try:
        if kind == "predict-input":
            pipe.predict(*inputs)
        else:
            pipe.step(*inputs, target=target)
        raised = None
    except Exception as error:  # noqa: BLE001 - the parent checks what it was
        raised = (type(error).__name__, str(error))
    if restore is not None:
        restore()
    after = _local_state(pipe)
    return {"raised": raised, "changed": [str(k) for k in before if not _same(before[k], after[k])]}


def _schedule_faults(rank: int, schedule: str) -> dict:
    """A good step, then per fault a failed step and a good one; the losses of the good steps and
    the state they reached, gathered from both ranks."""
    faults = CASES[schedule]
    model, batches, options = _problem(schedule in CLIPPED, len(faults) + 1)
    (bad,) = token_batches(1)
    inputs, target = batches[0]
    pipe = sw.compile(model, RANKS, inputs, example_target=target, schedule=schedule, cost="analytic",
                      swap="off", **options)
    pipe.timeout_s = TIMEOUT_S
    result: dict = {"losses": pipeline_train(pipe, batches[:1])}
    for fault, batch in zip(faults, batches[1:], strict=True):
        result[fault] = _failed_step(pipe, rank, fault, bad)
        result["losses"] += pipeline_train(pipe, [batch])
    result["state"] = {k: v.clone() for k, v in pipe.state_dict().items()}
    return result


def _fault_cases(rank: int, init_file: str, out: str) -> None:
    """Every schedule in turn on one pair of ranks, saving after each; the first unexpected error
    ends the run (the ranks could not go on together)."""
    join(init_file, rank, 30.0)
    torch.set_num_threads(1)
    path = Path(out) / f"rank{rank}.pkl"
    results = {}
    for schedule in CASES:
        try:
            results[schedule] = _schedule_faults(rank, schedule)
        except Exception:  # noqa: BLE001 - the parent shows it
            results[schedule] = {"error": traceback.format_exc()}
            break
        finally:
            save_result(path, results)
    os._exit(0)


@pytest.fixture(scope="module")
def faulted(tmp_path_factory) -> list[dict]:
    results = spawn(_fault_cases, tmp_path_factory.mktemp("faults"), limit_s=CASES_LIMIT_S, fail_on_hang=False)
    return [result or {} for result in results]


def _finished(faulted: list[dict], schedule: str) -> list[dict]:
    results = [per_rank.get(schedule) for per_rank in faulted]
    for rank, result in enumerate(results):
        assert result is not None, f"rank {rank} did not finish {schedule} (a hang, or an earlier schedule failed)"
        assert "error" not in result, f"rank {rank}:\n{result['error']}"
    return results


@pytest.mark.parametrize("schedule, fault", [(s, f) for s, faults in CASES.items() for f in faults],
                         ids=lambda part: part if isinstance(part, str) else "-".join(map(str, part)))
def test_a_step_failed_on_one_rank_is_undone_on_both(faulted, schedule, fault):
    """The failing rank raises its own exception, the other StepFailedError naming it (not a
    PeerError: nobody waited out the timeout); each rank's state is exactly as before the failed step."""
    failing_rank = fault[1]
    for rank, result in enumerate(_finished(faulted, schedule)):
        step = result[fault]
        assert step["raised"] is not None, f"rank {rank}: the step did not fail"
        name, message = step["raised"]
        if rank == failing_rank and fault[0] in ("input", "predict-input"):
            assert name == "ExampleInputsError" and "dtype" in message, step["raised"]
        elif rank == failing_rank:
            assert name == InjectedFault.__name__ and "on purpose" in message, step["raised"]
        else:
            assert name == "StepFailedError" and f"rank {failing_rank} failed" in message, step["raised"]
        assert step["changed"] == [], f"rank {rank}: the failed step changed {step['changed']}"


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_training_on_after_failed_steps_equals_eager_training_without_them(faulted, schedule):
    want, state = _eager(schedule in CLIPPED, len(CASES[schedule]) + 1)
    for result in _finished(faulted, schedule):
        torch.testing.assert_close(torch.stack(result["losses"]), torch.stack(want), rtol=RTOL, atol=ATOL)
        assert_state_equal(result["state"], state)
