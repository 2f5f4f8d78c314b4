"""An asynchronous save whose write is held back deterministically (`write_tensors` waits on an event
the test sets), in one process (tests/test_async_save.py) and on each of two gloo ranks
(tests/test_distributed_save.py runs `save_on_this_rank` and checks with `check_saved_on_two_ranks`)."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import stagewise as sw
from stagewise.compiler.checkpoint import write as checkpoint_write
from tests.models.mlp import mlp
from tests.reference import ADAMW, pipeline_train


def async_problem(schedule: str = "1f1b", **options) -> tuple[sw.Pipeline, list]:
    """An MLP with AdamW (optimizer state to snapshot) on 2 devices, and 4 batches, alike in every process."""
    torch.manual_seed(0)
    batches = [((torch.randn(8, 8),), torch.randint(0, 5, (8,))) for _ in range(4)]
    pipe = sw.compile(mlp(), 2, batches[0][0], loss_fn=F.cross_entropy, example_target=batches[0][1],
                      optimizer=ADAMW, microbatches=2, schedule=schedule, cost="analytic", **options)
    pipe.timeout_s = 20.0
    return pipe, batches


def held_writes(monkeypatch: pytest.MonkeyPatch | None = None) -> threading.Event:
    """Make every checkpoint's tensor write wait until the returned event is set."""
    gate, write = threading.Event(), checkpoint_write.write_tensors

    def held(*args, **kwargs) -> None:
        assert gate.wait(30.0), "the test never let the write go"
        write(*args, **kwargs)

    if monkeypatch is None:
        checkpoint_write.write_tensors = held
    else:
        monkeypatch.setattr(checkpoint_write, "write_tensors", held)
    return gate


def assert_exact(got: dict, want: dict) -> None:
    assert set(got) == set(want)
    for name, tensor in want.items():
        torch.testing.assert_close(got[name], tensor, rtol=0, atol=0, msg=lambda m, n=name: f"{n}: {m}")


def save_on_this_rank(directory: Path) -> dict:
    """On each of two gloo ranks: an asynchronous save, its write held back while a step runs, then
    let go while the next step runs beside DCP's collectives on the checkpoints' group."""
    pipe, batches = async_problem()
    pipeline_train(pipe, batches[:2])
    result = {"state": {k: v.clone() for k, v in pipe.state_dict().items()}}  # gathered from both ranks
    write = checkpoint_write.write_tensors
    gate = held_writes()
    try:
        handle = pipe.save(directory, asynchronous=True)
        pipeline_train(pipe, batches[2:3])
        result["done after a step"] = handle.done()
        gate.set()
        pipeline_train(pipe, batches[3:])
        pipe.wait_for_save()
    finally:
        gate.set()
        checkpoint_write.write_tensors = write  # the ranks go on to other saves
    result["after"] = {k: v.clone() for k, v in pipe.state_dict().items()}
    return result


def check_saved_on_two_ranks(directory: Path, results: list[dict]) -> None:
    """The checkpoint holds the state at the save, each rank wrote its own shard, and training the
    loaded pipeline on ends where the ranks did."""
    for rank, result in enumerate(results):
        assert "error" not in result, f"rank {rank}: {result.get('error')}"
        assert not result["done after a step"]
    loaded = sw.load(directory)
    assert_exact(loaded.state_dict(), results[0]["state"])
    assert loaded._executor.state.iteration == 2
    assert sorted(p.name for p in (directory / "weights").iterdir()) == [".metadata", "__0_0.distcp",
                                                                          "__1_0.distcp"]
    _, batches = async_problem()
    pipeline_train(loaded, batches[2:])
    assert_exact(loaded.state_dict(), results[0]["after"])
