"""`sw.Checkpoints`: periodic checkpoints of a training loop, and resuming from the newest that loads.

A job that loses a machine is restarted by its launcher (`torchrun --max-restarts=N`, elastic
`--nnodes=MIN:MAX`) on the ranks that remain: the script compiles again for the devices it has
now, and `resume` puts the latest complete checkpoint into that pipeline through `pipe.restore`,
which re-shards a checkpoint of any plan of the same model by name (Varuna §4.5). So surviving a
lost machine is three lines in a training loop: `start = checkpoints.resume(pipe, scheduler)`,
`for step in range(start, steps)`, `checkpoints.after_step(pipe, scheduler)`.

Layout: `directory/step_<n>`, each written by `pipe.save`, which puts a checkpoint in place
atomically, so a folder of that name is a finished save (a save that died left only a staging
folder, which is ignored). The newest `keep` are kept; older ones are removed only after the new
one is in place, so a crash at any moment leaves at least the previous checkpoints. A newest one
damaged since (a shard that fails its SHA-256) is passed over with a warning for the one before.

Under torch.distributed saving and restoring are collectives, so every rank must decide alike:
the step count (`pipe._executor.state.iteration`, completed steps only) is the same on every rank;
clocks are not, so with `every_seconds` rank 0 decides and tells the others, and the list of
checkpoints to resume from is rank 0's listing (across machines `directory` must be on a
filesystem every rank shares, as for `pipe.save`).
"""

from __future__ import annotations

import os
import re
import time
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from stagewise.compiler.assembly.options import check_flags
from stagewise.compiler.checkpoint.arguments import checkpoints_folder
from stagewise.compiler.checkpoint.files import remove_own_folder
from stagewise.ir.errors import CheckpointError, OptionError, PlanError
from stagewise.runtime.distributed import DistributedTransport

if TYPE_CHECKING:
    from stagewise.compiler.checkpoint.async_save import SaveHandle
    from stagewise.compiler.pipeline.pipeline import Pipeline

_STEP_FOLDER = re.compile(r"step_(\d+)")
_T = TypeVar("_T")


class Checkpoints:
    """Checkpoints of one training run under `directory`: every `every_steps` steps and/or every
    `every_seconds` seconds (whichever comes first), the newest `keep` kept (old ones removed only
    once the new one is in place), and `resume` from the newest that loads.

    Args:
        directory: the folder holding the run's `step_<n>` checkpoints.
        every_steps: save after every this many steps, or None.
        every_seconds: save once this many seconds have passed since the last, or None.
        keep: how many checkpoints to keep.
        asynchronous: each save returns once the state is copied to CPU memory and writes while
            training goes on (`pipe.save(asynchronous=True)`); older checkpoints go once it is in place.

    Raises:
        OptionError: neither `every_steps` nor `every_seconds`, a value that is not positive, or
            `asynchronous` not a bool.

    Example:
        >>> checkpoints = sw.Checkpoints(tmp / "run", every_steps=1, keep=1)
        >>> _ = pipe.step(x, target=y)
        >>> checkpoints.after_step(pipe)
        True
        >>> checkpoints.resume(pipe) == checkpoints.saved_steps()[-1]
        True
    """

    def __init__(self, directory, every_steps: int | None = None, every_seconds: float | None = None,
                 keep: int = 2, asynchronous: bool = False):
        _check_options(every_steps, every_seconds, keep)
        check_flags(asynchronous=asynchronous)
        self.directory = checkpoints_folder(directory)
        self.every_steps = every_steps
        self.every_seconds = every_seconds
        self.keep = keep
        self._last_step: int | None = None  # the step of the checkpoint saved or resumed last
        self._last_time = time.monotonic()
        self._rank_0 = True  # whether this process removes old checkpoints (rank 0's job)
        self._damaged: set[int] = set()  # steps whose checkpoint failed to restore: never counted as kept
        self.asynchronous = asynchronous
        self._in_flight: tuple[int, SaveHandle] | None = None  # an asynchronous save not yet pruned after

    def path(self, step: int) -> Path:
        """Where a step's checkpoint goes.

        Args:
            step: completed training steps.

        Returns:
            `directory / f"step_{step}"`.

        Example:
            >>> sw.Checkpoints(tmp / "paths", every_steps=10).path(20).name
            'step_20'
        """
        return self.directory / f"step_{step}"

    def saved_steps(self) -> list[int]:
        """The steps of the checkpoint folders under `directory`.

        Returns:
            The steps, oldest first; [] where the folder does not exist yet.

        Example:
            >>> sw.Checkpoints(tmp / "empty", every_steps=10).saved_steps()
            []
        """
        if not self.directory.is_dir():
            return []
        steps = []
        for entry in self.directory.iterdir():
            match = _STEP_FOLDER.fullmatch(entry.name)
            if match and entry.is_dir() and not entry.is_symlink():
                steps.append(int(match.group(1)))
        return sorted(steps)

    def resume(self, pipe: Pipeline, scheduler=None) -> int:
        """Restore the latest checkpoint that loads into `pipe` (compiled for any devices: it is
        re-sharded by name) and, if given, `scheduler` (made over `pipe.optimizer` beforehand);
        returns the step to go on from: the saved step count, 0 where there is none.
        A collective under torch.distributed. A checkpoint that fails to restore is warned about
        and the one before it tried.

        Args:
            pipe: the pipeline to restore into, of any plan of the same model.
            scheduler: a scheduler made over `pipe.optimizer`, to restore too.

        Returns:
            The step to go on from.

        Raises:
            CheckpointError: checkpoints exist but none could be restored.

        Example:
            >>> sw.Checkpoints(tmp / "fresh", every_steps=10).resume(pipe)
            0
        """
        _warn_shared_store()
        failures = []
        for step in reversed(_from_rank_0(pipe, self.saved_steps())):
            try:
                pipe.restore(self.path(step))
            except PlanError as error:  # damaged, or not this model's: every rank raises alike
                failures.append(f"{self.path(step)}: {error}")
                self._damaged.add(step)
                warnings.warn(f"checkpoint {self.path(step)} could not be restored ({error}); "
                              "trying the one before it", stacklevel=2)
                continue
            if scheduler is not None:
                pipe.load_scheduler(scheduler)
            self._last_step, self._last_time = pipe._executor.state.iteration, time.monotonic()
            return pipe._executor.state.iteration
        if failures:
            raise CheckpointError(f"no checkpoint under {self.directory} could be restored ({'; '.join(failures)}); "
                                  "move the damaged ones away to start from scratch")
        self._last_time = time.monotonic()
        return 0

    def after_step(self, pipe: Pipeline, scheduler=None, extra: dict | None = None) -> bool:
        """Call after every step (and `scheduler.step()`): saves a checkpoint when one is due.
        Every rank calls it under torch.distributed.

        Args:
            pipe: the pipeline that stepped.
            scheduler: its learning-rate scheduler, whose state to keep.
            extra: metadata to keep (`pipe.extra` after loading).

        Returns:
            Whether it saved.

        Example:
            >>> checkpoints = sw.Checkpoints(tmp / "every_step", every_steps=1)
            >>> _ = pipe.step(x, target=y)
            >>> checkpoints.after_step(pipe), checkpoints.after_step(pipe)  # once per step
            (True, False)
        """
        self._prune_after_save(wait=False)
        step = pipe._executor.state.iteration
        if step == 0 or step == self._last_step:
            return False
        due = self.every_steps is not None and step % self.every_steps == 0
        if not due and self.every_seconds is not None:  # rank 0's clock decides for every rank
            due = _from_rank_0(pipe, time.monotonic() - self._last_time >= self.every_seconds)
        if due:
            self.save(pipe, scheduler, extra)
        return due

    def save(self, pipe: Pipeline, scheduler=None, extra: dict | None = None) -> Path:
        """Save now (as `step_<steps so far>`), then remove all but the newest `keep` (asynchronous:
        once it is in place, seen by a later call or `wait`).

        Args:
            pipe: the pipeline to save.
            scheduler: its learning-rate scheduler, whose state to keep.
            extra: metadata to keep.

        Returns:
            The checkpoint's path.

        Raises:
            CheckpointError: as `pipe.save`, or the asynchronous save before this one failed.

        Example:
            >>> checkpoints = sw.Checkpoints(tmp / "now", every_seconds=3600)
            >>> checkpoints.save(pipe).parent.name
            'now'
        """
        self._prune_after_save(wait=True)
        step = pipe._executor.state.iteration
        target = self.path(step)
        handle = pipe.save(target, scheduler=scheduler, extra=extra, asynchronous=self.asynchronous)
        self._last_step, self._last_time = step, time.monotonic()
        self._damaged.discard(step)
        self._rank_0 = pipe.context is None or pipe.context.rank == 0
        self._in_flight = (step, handle)
        self._prune_after_save(wait=not self.asynchronous)
        return target

    def wait(self) -> None:
        """Wait for an asynchronous save in flight and prune after it (before the run ends).

        Raises:
            CheckpointError: the save failed.

        Example:
            >>> checkpoints = sw.Checkpoints(tmp / "async", every_steps=1, asynchronous=True)
            >>> path = checkpoints.save(pipe)
            >>> checkpoints.wait()
            >>> path.is_dir()
            True
        """
        self._prune_after_save(wait=True)

    def _prune_after_save(self, wait: bool) -> None:
        """Once the last save is in place (waiting for it with `wait`), remove what it makes surplus."""
        if self._in_flight is None or not (wait or self._in_flight[1].done()):
            return
        step, handle = self._in_flight
        self._in_flight = None
        handle.wait()  # a failed save raises here: nothing older is removed
        if self._rank_0:
            self._prune(step)

    def _prune(self, newest: int) -> None:
        """Remove the checkpoints older than `newest` beyond the `keep - 1` most recent sound ones.
        Damaged ones and those above `newest` are left for the user to look at."""
        older = [s for s in self.saved_steps() if s < newest and s not in self._damaged]
        for step in older[:max(0, len(older) - (self.keep - 1))]:
            try:
                remove_own_folder(self.path(step))
            except (OSError, CheckpointError) as error:
                warnings.warn(f"could not remove the old checkpoint {self.path(step)}: {error}", stacklevel=3)


def _from_rank_0(pipe: Pipeline, value: _T) -> _T:
    """Rank 0's `value` on every rank (this process's alone)."""
    transport = pipe._runtime.transport
    return transport.from_first(value) if isinstance(transport, DistributedTransport) else value


def _warn_shared_store() -> None:
    """torchrun (2.5 and later) hands its rendezvous store to the workers; a restart at the same world
    size then reads the last attempt's addresses and fails to connect (pytorch/pytorch#135712)."""
    if (os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
            and int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0) > 0):
        warnings.warn("torchrun shares its rendezvous store with the workers, so a restart at the same world size may "
                      "fail to connect (pytorch/pytorch#135712): set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in "
                      "torchrun's environment", stacklevel=3)


def _check_options(every_steps: object, every_seconds: object, keep: object) -> None:
    """Refuse settings that would never save, or keep nothing."""
    if every_steps is None and every_seconds is None:
        raise OptionError("sw.Checkpoints needs every_steps= (an int) or every_seconds= (a number), or both")
    if every_steps is not None and (not isinstance(every_steps, int) or isinstance(every_steps, bool)
                                    or every_steps < 1):
        raise OptionError(f"sw.Checkpoints(every_steps=...) takes a positive int, got {every_steps!r}")
    if every_seconds is not None and (not isinstance(every_seconds, int | float) or isinstance(every_seconds, bool)
                                      or not every_seconds > 0):
        raise OptionError(f"sw.Checkpoints(every_seconds=...) takes a positive number, got {every_seconds!r}")
    if not isinstance(keep, int) or isinstance(keep, bool) or keep < 1:
        raise OptionError(f"sw.Checkpoints(keep=...) takes a positive int (how many checkpoints to keep), got {keep!r}")
