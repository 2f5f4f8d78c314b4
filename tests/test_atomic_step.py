"""Atomic steps in one process: a step that fails anywhere leaves the pipeline as before it.

Faults are injected the way a user's model fails: a function in the model (kept a call in the
traced graph by `torch.fx.wrap`) raises in its forward, in the backward of its custom autograd
Function, or in the recompute of its forward, on the n-th call of the step; an optimizer raises
in its n-th `step`. After each failed step the pipeline's state_dict, optimizer state, buffers,
gradients and memory pools equal what they were before it; the same batch is then stepped
again, and at the end training equals eager training that never saw the failed attempts.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import stagewise as sw
from tests.harness.faults import (
    ADAMW,
    EAGER_ADAMW,
    EAGER_SGD,
    FAULTS,
    FOUR,
    MICROBATCHES,
    SGD,
    TWO,
    InjectedBackwardError,
    X,
    Y,
    fail_once,
    model,
    rolled_back_as_eager,
    stuck_stage_meets_the_deadline,
)
from tests.reference import assert_state_equal, eager_train

CASES = [
    ("gpipe", {"split_points": TWO}, True),
    ("1f1b", {"split_points": TWO, "optimizer_on_host": True}, True),
    ("interleaved", {"split_points": FOUR}, True),
    ("varuna", {"split_points": TWO}, False),  # BatchNorm under recompute is another part of issue 10
    ("harmony-pp", {"split_points": FOUR, "swap": "all"}, False),
    ("harmony-dp", {"split_points": TWO}, False),
]


@pytest.mark.parametrize(("schedule", "options", "batchnorm"), CASES, ids=[c[0] for c in CASES])
def test_a_failed_step_is_rolled_back_and_training_goes_on_as_eager(schedule, options, batchnorm):
    rolled_back_as_eager(schedule, options, batchnorm)


def test_a_forward_only_pass_updates_no_stage_so_records_no_undo():
    """On a GPU the undo record of each stage the step updates is queued at the step's start
    (runtime/rollback.py): a forward-only pass (evaluate, predict) updates none, so it queues none."""
    pipe = sw.compile(model(batchnorm=False), 2, (X,), loss_fn=F.cross_entropy, example_target=Y, optimizer=SGD,
                      microbatches=MICROBATCHES, schedule="1f1b", split_points=TWO)
    pipe.evaluate(X, target=Y)
    assert pipe._evaluation._executor.state.updated == frozenset()
    assert pipe._executor.state.updated == {0, 1}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize(("optimizer", "eager_optimizer"), [(SGD, EAGER_SGD), (ADAMW, EAGER_ADAMW)], ids=["sgd", "adamw"])
def test_a_failed_update_on_a_gpu_is_undone_from_the_record_queued_at_the_step_s_start(optimizer, eager_optimizer):
    """On a GPU a resident stage's undo record is copied on a side stream from the step's start
    (runtime/rollback.py); AdamW's `step` counts, on the host, right before the update. A later
    stage's failed update undoes an earlier stage's finished one, with and without optimizer state."""
    torch.backends.cuda.matmul.allow_tf32 = False
    net = model(batchnorm=True)
    reference = copy.deepcopy(net).cuda()
    pipe = sw.compile(net, ["cuda:0", "cuda:0"], (X,), loss_fn=F.cross_entropy, example_target=Y,
                      optimizer=optimizer, microbatches=MICROBATCHES, schedule="1f1b", split_points=TWO)
    faults = [("update", 2), ("update", 1), ("update", 2)]  # the first without optimizer state
    batches = [((torch.randn(8, 8),), torch.randint(0, 5, (8,))) for _ in faults]
    for (kind, nth), batch in zip(faults, batches, strict=True):
        assert type(fail_once(pipe, kind, nth, batch)) is RuntimeError
        pipe.step(*batch[0], target=batch[1])
    assert pipe._executor.state.guard.side_streams  # the records were queued early
    on_gpu = [((x.cuda(),), y.cuda()) for (x,), y in batches]
    eager_train(reference, on_gpu, loss_fn=F.cross_entropy, optimizer=eager_optimizer, microbatches=MICROBATCHES)
    assert_state_equal({k: v.cpu() for k, v in pipe.state_dict().items()},
                       {k: v.cpu() for k, v in reference.state_dict().items()})


def test_a_stuck_stage_meets_the_deadline_and_the_pipeline_waits_for_it(tmp_path):
    stuck_stage_meets_the_deadline(tmp_path)


def test_a_step_whose_rollback_fails_breaks_the_pipeline(tmp_path):
    pipe = sw.compile(model(batchnorm=False), 2, (X,), loss_fn=F.cross_entropy, example_target=Y, optimizer=SGD,
                      microbatches=MICROBATCHES, schedule="gpipe", split_points=TWO)
    FAULTS.recomputes = False

    def broken_drain():
        raise OSError("transport lost")

    pipe._runtime.transport.drain = broken_drain
    FAULTS.arm("backward", 2)
    try:
        with pytest.raises(InjectedBackwardError) as info:
            pipe.step(X, target=Y)
    finally:
        FAULTS.arm(None)
    assert "broken since step 1" in " ".join(info.value.__notes__)
    with pytest.raises(sw.PipelineBrokenError, match=r"since step 1: its rollback failed \(OSError: transport lost\).*sw.load"):
        pipe.step(X, target=Y)
    with pytest.raises(sw.PipelineBrokenError):
        pipe.save(tmp_path / "checkpoint")
    assert set(pipe.state_dict())  # the state may still be read
