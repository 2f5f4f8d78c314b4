"""Saving in the background: `pipe.save(directory, asynchronous=True)` overlaps training with the write.

The save returns once this process's state is copied to CPU memory (a snapshot: the steps that
follow cannot change what is written) and the staging folder is open; a thread then writes the
tensors (DCP), the small files, and swaps the folder into place (compiler/checkpoint/write.py),
so a crash at any moment still leaves the old or the new checkpoint. Under torch.distributed the
thread's collectives run over the transport's gloo group for checkpoints, never the groups the
steps use, and the swap happens only once every rank's tensors and DCP's metadata are written.
The copy costs host memory the size of this process's weights and optimizer state until written.

The rules (one save in flight per pipeline, so two saves' collectives never interleave):
- what cannot start (a target that is not a checkpoint, a rank that cannot take its state) raises
  from `save` itself, as a synchronous save does;
- a save (synchronous or not), `pipe.restore` and `pipe.wait_for_save()` first wait for the save in
  flight;
- a failure in the background leaves the earlier checkpoint at the path intact and removes the
  staging folder; it is a CheckpointError naming the path, raised by `handle.wait()` (every time it
  is called) and, unless `wait()` raised it already, once by the next `pipe.save`,
  `pipe.wait_for_save()` or `pipe.restore`. Steps never raise it: training goes on;
- at exit the interpreter waits for the thread (not a daemon), and a failure nobody was told of
  is written to stderr. Under torch.distributed call `pipe.wait_for_save()` before
  `dist.destroy_process_group()`: the thread's collectives need the group.
"""

from __future__ import annotations

import atexit
import sys
import threading
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

from stagewise.compiler.assembly.runtime_setup import Runtime
from stagewise.compiler.checkpoint.write import prepare
from stagewise.ir.errors import CheckpointError
from stagewise.ir.plan import Plan

_UNREPORTED: set[SaveHandle] = set()  # running, or failed without anyone told: reported at exit


class SaveHandle:
    """A checkpoint being written (returned by `pipe.save`; a synchronous save's is done already).
    `path`: where it goes; `done()`: whether it has finished; `wait()`: until it has, raising its failure.
    A failure no one waited for is printed at exit.

    Args:
        path: the checkpoint's folder.
        finish: what writes it, run on a thread; None for a save already done.

    Example:
        >>> handle = pipe.save(tmp / "handle", asynchronous=True)
        >>> handle.wait()
        >>> handle
        SaveHandle('.../handle', done)
    """

    def __init__(self, path: Path, finish: Callable[[], None] | None = None):
        self.path = path
        self._failure: CheckpointError | None = None
        self._reported = False
        self._thread: threading.Thread | None = None
        if finish is not None:
            self._thread = threading.Thread(target=self._run, args=(finish,), name=f"stagewise save {path}")
            _UNREPORTED.add(self)
            self._thread.start()

    def __repr__(self) -> str:
        state = "failed" if self._failure is not None else "done" if self.done() else "writing"
        return f"SaveHandle({str(self.path)!r}, {state})"

    def done(self) -> bool:
        """Whether the save has finished, without waiting.

        Returns:
            True once the checkpoint is in place, or the save failed.

        Example:
            >>> pipe.save(tmp / "done").done()
            True
        """
        return self._thread is None or not self._thread.is_alive()

    def wait(self) -> None:
        """Block until the checkpoint is in place.

        Raises:
            CheckpointError: the save failed (any earlier checkpoint there is intact); the error
                it met is its cause.

        Example:
            >>> handle = pipe.save(tmp / "waited", asynchronous=True)
            >>> handle.wait()
            >>> sorted(path.name for path in (tmp / "waited").iterdir())[:2]
            ['graph.json', 'plan.json']
        """
        if self._thread is not None:
            self._thread.join()
        if self._failure is not None:
            self._reported = True
            _UNREPORTED.discard(self)
            raise self._failure

    def settle(self) -> None:
        """`wait`, raising the failure only if no `wait` raised it yet (what the pipeline's next save
        calls, so that one failure is raised once).

        Raises:
            CheckpointError: the save failed and no `wait` raised it yet.

        Example:
            >>> handle = pipe.save(tmp / "settled", asynchronous=True)
            >>> handle.settle()
            >>> handle.done()
            True
        """
        if self._thread is not None:
            self._thread.join()
        if not self._reported:
            self.wait()

    def _run(self, finish: Callable[[], None]) -> None:
        """The thread: write, and keep the failure for `wait`. Not its traceback, whose frames hold the
        snapshot (GBs of host memory): that goes as text in a note."""
        try:
            finish()
        except BaseException as error:  # noqa: BLE001 - kept for wait(), never lost
            error.add_note("in the save's thread:\n" + "".join(traceback.format_tb(error.__traceback__)).rstrip())
            failure = CheckpointError(f"the asynchronous pipe.save({str(self.path)!r}) failed in the background "
                                      f"({type(error).__name__}: {error}); any earlier checkpoint there is intact")
            failure.__cause__ = error.with_traceback(None)
            self._failure = failure
            return
        _UNREPORTED.discard(self)


class SaveSlot:
    """A pipeline's one save in flight: each new save waits for it first."""

    def __init__(self) -> None:
        self.current: SaveHandle | None = None

    def settle(self) -> None:
        """Wait for the save in flight, if any; raise its failure unless its handle already did."""
        handle = self.current
        if handle is None:
            return
        try:
            handle.settle()
        finally:
            if handle.done():  # else interrupted (Ctrl-C): still in flight, the next save waits again
                self.current = None

    def save(self, plan: Plan, runtime: Runtime, directory, unheld: dict[str, torch.Tensor], training: dict,
             asynchronous: bool) -> SaveHandle:
        """Save now, or start a save and return while its thread writes (the first half raises here)."""
        self.settle()
        finish = prepare(plan, runtime, directory, unheld, training, snapshot=asynchronous)
        if not asynchronous:
            finish()
            return SaveHandle(Path(directory))
        self.current = SaveHandle(Path(directory), finish)
        return self.current


@atexit.register
def _report_at_exit() -> None:
    """Tell of every failed save no one waited for (the interpreter has joined the threads by now)."""
    for handle in list(_UNREPORTED):
        if handle._thread is not None:
            handle._thread.join()
        if handle._failure is not None and not handle._reported:
            print(f"stagewise: {handle._failure}", file=sys.stderr)
        _UNREPORTED.discard(handle)
