"""`pipe.save(directory, asynchronous=True)`: training overlaps the write, and the checkpoint holds
the state at the save, not after; a failure in the background is raised, never lost, and leaves the
earlier checkpoint intact; one save at a time; under two gloo ranks the same (compiler/checkpoint_async.py):
that case runs on tests/test_distributed_save.py's pair of ranks (one process-group start for both
files), with `save_on_this_rank` and `check_saved_on_two_ranks` from here.

The write is held back deterministically (`write_tensors` waits on an event the test sets), so
"the steps returned before the save completed" is a fact, not a timing.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import stagewise as sw
from stagewise.compiler import checkpoint_async, checkpoint_write
from stagewise.ir.errors import CheckpointError
from tests.models.mlp import mlp
from tests.reference import ADAMW, pipeline_train


def _problem(schedule: str = "1f1b", **options) -> tuple[sw.Pipeline, list]:
    """An MLP with AdamW (optimizer state to snapshot) on 2 devices, and 4 batches, alike in every process."""
    torch.manual_seed(0)
    batches = [((torch.randn(8, 8),), torch.randint(0, 5, (8,))) for _ in range(4)]
    pipe = sw.compile(mlp(), 2, batches[0][0], loss_fn=F.cross_entropy, example_target=batches[0][1],
                      optimizer=ADAMW, microbatches=2, schedule=schedule, cost="analytic", **options)
    pipe.timeout_s = 20.0
    return pipe, batches


def _held(monkeypatch=None) -> threading.Event:
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


def _failing(*args, **kwargs) -> None:
    raise OSError("no space left on device, on purpose")


def _files(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in directory.rglob("*") if p.is_file()}


def optimizer_state(pipe) -> dict:
    """tests/test_save_load.py's, imported here: it imports transformers, 2 s in each spawned rank."""
    from tests.test_save_load import optimizer_state

    return optimizer_state(pipe)


def _snapshot(pipe) -> tuple[dict, dict]:
    return ({k: v.clone() for k, v in pipe.state_dict().items()},
            {k: v.clone() for k, v in optimizer_state(pipe).items()})


def _assert_exact(got: dict, want: dict) -> None:
    assert set(got) == set(want)
    for name, tensor in want.items():
        torch.testing.assert_close(got[name], tensor, rtol=0, atol=0, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("schedule, swap", [("1f1b", "off"), ("harmony-pp", "on")], ids=["1f1b", "swapped"])
def test_steps_run_while_it_writes_and_it_holds_the_state_at_the_save(tmp_path, monkeypatch, schedule, swap):
    pipe, batches = _problem(schedule, swap=swap)
    pipeline_train(pipe, batches[:2])
    state, moments = _snapshot(pipe)
    gate = _held(monkeypatch)
    handle = pipe.save(tmp_path / "ck", asynchronous=True)
    assert handle.path == tmp_path / "ck" and not handle.done()
    after = pipeline_train(pipe, batches[2:])  # the steps return while the write waits
    assert not handle.done() and not (tmp_path / "ck").exists()
    gate.set()
    handle.wait()
    assert handle.done()
    loaded = sw.load(tmp_path / "ck")
    _assert_exact(loaded.state_dict(), state)  # the state at the save, not after the two steps
    _assert_exact(optimizer_state(loaded), moments)
    assert loaded.executor.iteration == 2
    alone, _ = _problem(schedule, swap=swap)  # the same training, never saved
    want = pipeline_train(alone, batches)
    torch.testing.assert_close(torch.stack(after), torch.stack(want[2:]), rtol=0, atol=0)
    _assert_exact(pipe.state_dict(), alone.state_dict())
    torch.testing.assert_close(torch.stack(pipeline_train(loaded, batches[2:])), torch.stack(want[2:]), rtol=0, atol=0)


def test_a_failure_in_the_background_is_raised_and_keeps_the_earlier_checkpoint(tmp_path, monkeypatch, capsys):
    pipe, batches = _problem()
    pipeline_train(pipe, batches[:1])
    assert pipe.save(tmp_path / "ck").done()  # synchronous: done when it returns
    before = _files(tmp_path / "ck")
    pipeline_train(pipe, batches[1:2])
    monkeypatch.setattr(checkpoint_write, "write_tensors", _failing)
    handle = pipe.save(tmp_path / "ck", asynchronous=True)
    for _ in range(2):  # every wait raises it
        with pytest.raises(CheckpointError, match=f"{tmp_path / 'ck'}.*OSError: no space left.*earlier checkpoint"):
            handle.wait()
    pipe.wait_for_save()  # told already: the pipeline does not raise it again
    assert _files(tmp_path / "ck") == before and sorted(p.name for p in tmp_path.iterdir()) == ["ck"]
    assert sw.load(tmp_path / "ck").executor.iteration == 1

    pipe.save(tmp_path / "ck", asynchronous=True)  # fails again, and no one waits for it
    pipeline_train(pipe, batches[2:3])  # steps never raise it
    monkeypatch.undo()
    with pytest.raises(CheckpointError, match="OSError: no space left"):
        pipe.save(tmp_path / "ck")  # the next save does, and does not start
    assert _files(tmp_path / "ck") == before
    pipe.save(tmp_path / "ck")
    assert sw.load(tmp_path / "ck").executor.iteration == 3

    monkeypatch.setattr(checkpoint_write, "write_tensors", _failing)
    handle = pipe.save(tmp_path / "ck", asynchronous=True)
    while not handle.done():
        time.sleep(0.01)
    checkpoint_async._report_at_exit()  # at exit, a failure no one was told of goes to stderr
    assert "asynchronous pipe.save" in capsys.readouterr().err


def test_a_save_waits_for_the_one_in_flight(tmp_path, monkeypatch):
    pipe, batches = _problem()
    pipeline_train(pipe, batches[:1])
    gate = _held(monkeypatch)
    first = pipe.save(tmp_path / "a", asynchronous=True)
    pipeline_train(pipe, batches[1:2])
    threading.Timer(0.2, gate.set).start()
    pipe.save(tmp_path / "b")  # blocks until the first is in place
    assert first.done()
    assert [sw.load(tmp_path / n).executor.iteration for n in ("a", "b")] == [1, 2]


# ---- under two gloo ranks: tests/test_distributed_save.py's pair of ranks runs these ----------
def save_on_this_rank(directory: Path) -> dict:
    """On each of two gloo ranks: an asynchronous save, its write held back while a step runs, then
    let go while the next step runs beside DCP's collectives on the checkpoints' group."""
    pipe, batches = _problem()
    pipeline_train(pipe, batches[:2])
    result = {"state": {k: v.clone() for k, v in pipe.state_dict().items()}}  # gathered from both ranks
    write = checkpoint_write.write_tensors
    gate = _held()
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
    _assert_exact(loaded.state_dict(), results[0]["state"])
    assert loaded.executor.iteration == 2
    assert sorted(p.name for p in (directory / "weights").iterdir()) == [".metadata", "__0_0.distcp",
                                                                          "__1_0.distcp"]
    _, batches = _problem()
    pipeline_train(loaded, batches[2:])
    _assert_exact(loaded.state_dict(), results[0]["after"])
