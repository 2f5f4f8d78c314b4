"""`pipe.save(directory, asynchronous=True)`: training overlaps the write, and the checkpoint holds
the state at the save, not after; a failure in the background is raised, never lost, and leaves the
earlier checkpoint intact; one save at a time; under two gloo ranks the same (compiler/checkpoint/async_save.py):
that case runs on tests/test_distributed_save.py's pair of ranks (one process-group start for both
files), with `save_on_this_rank` and `check_saved_on_two_ranks` from tests/harness/async_save.py.

The write is held back deterministically (`write_tensors` waits on an event the test sets), so
"the steps returned before the save completed" is a fact, not a timing.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch

import stagewise as sw
from stagewise.compiler.checkpoint import async_save as checkpoint_async
from stagewise.compiler.checkpoint import write as checkpoint_write
from stagewise.ir.errors import CheckpointError
from tests.harness.async_save import assert_exact, async_problem, held_writes
from tests.harness.checkpoints import optimizer_state
from tests.reference import pipeline_train


def _failing(*args, **kwargs) -> None:
    raise OSError("no space left on device, on purpose")


def _files(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in directory.rglob("*") if p.is_file()}


def _snapshot(pipe) -> tuple[dict, dict]:
    return ({k: v.clone() for k, v in pipe.state_dict().items()},
            {k: v.clone() for k, v in optimizer_state(pipe).items()})


@pytest.mark.parametrize("schedule, swap", [("1f1b", "off"), ("harmony-pp", "on")], ids=["1f1b", "swapped"])
def test_steps_run_while_it_writes_and_it_holds_the_state_at_the_save(tmp_path, monkeypatch, schedule, swap):
    pipe, batches = async_problem(schedule, swap=swap)
    pipeline_train(pipe, batches[:2])
    state, moments = _snapshot(pipe)
    gate = held_writes(monkeypatch)
    handle = pipe.save(tmp_path / "ck", asynchronous=True)
    assert handle.path == tmp_path / "ck" and not handle.done()
    after = pipeline_train(pipe, batches[2:])  # the steps return while the write waits
    assert not handle.done() and not (tmp_path / "ck").exists()
    gate.set()
    handle.wait()
    assert handle.done()
    loaded = sw.load(tmp_path / "ck")
    assert_exact(loaded.state_dict(), state)  # the state at the save, not after the two steps
    assert_exact(optimizer_state(loaded), moments)
    assert loaded._executor.state.iteration == 2
    alone, _ = async_problem(schedule, swap=swap)  # the same training, never saved
    want = pipeline_train(alone, batches)
    torch.testing.assert_close(torch.stack(after), torch.stack(want[2:]), rtol=0, atol=0)
    assert_exact(pipe.state_dict(), alone.state_dict())
    torch.testing.assert_close(torch.stack(pipeline_train(loaded, batches[2:])), torch.stack(want[2:]), rtol=0, atol=0)


def test_a_failure_in_the_background_is_raised_and_keeps_the_earlier_checkpoint(tmp_path, monkeypatch, capsys):
    pipe, batches = async_problem()
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
    assert sw.load(tmp_path / "ck")._executor.state.iteration == 1

    pipe.save(tmp_path / "ck", asynchronous=True)  # fails again, and no one waits for it
    pipeline_train(pipe, batches[2:3])  # steps never raise it
    monkeypatch.undo()
    with pytest.raises(CheckpointError, match="OSError: no space left"):
        pipe.save(tmp_path / "ck")  # the next save does, and does not start
    assert _files(tmp_path / "ck") == before
    pipe.save(tmp_path / "ck")
    assert sw.load(tmp_path / "ck")._executor.state.iteration == 3

    monkeypatch.setattr(checkpoint_write, "write_tensors", _failing)
    handle = pipe.save(tmp_path / "ck", asynchronous=True)
    while not handle.done():
        time.sleep(0.01)
    checkpoint_async._report_at_exit()  # at exit, a failure no one was told of goes to stderr
    assert "asynchronous pipe.save" in capsys.readouterr().err


def test_a_save_waits_for_the_one_in_flight(tmp_path, monkeypatch):
    pipe, batches = async_problem()
    pipeline_train(pipe, batches[:1])
    gate = held_writes(monkeypatch)
    first = pipe.save(tmp_path / "a", asynchronous=True)
    pipeline_train(pipe, batches[1:2])
    threading.Timer(0.2, gate.set).start()
    pipe.save(tmp_path / "b")  # blocks until the first is in place
    assert first.done()
    assert [sw.load(tmp_path / n)._executor.state.iteration for n in ("a", "b")] == [1, 2]
