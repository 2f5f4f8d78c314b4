"""What the executor does when a step fails: every rank agrees, then the step is undone.

A step that fails anywhere (an instruction of this process raised, its deadline passed, or,
under torch.distributed, a peer failed: `transport.conclude` says) is rolled back on every
stage (runtime/rollback.py) after every stream thread stopped and the transport was drained,
and the original exception is raised again with a note naming where it was raised and that
the step was rolled back. A rank whose own threads succeeded raises `StepFailedError`.

Two cases cannot be undone at once:

- a thread still runs user code at the deadline (it cannot be killed): `step` returns without
  joining it, and the pipeline refuses to step or save until it has returned; the first call
  after that rolls the step back and goes on;
- the guarantee cannot be kept (the rollback itself raised, or the ranks could not agree on the
  outcome): the pipeline marks itself broken and every later step or save raises
  `PipelineBrokenError` saying since when, why, and how to recover.
"""

from __future__ import annotations

from dataclasses import dataclass

from stagewise.ir.errors import PipelineBrokenError, StepFailedError, StepTimeoutError
from stagewise.ir.instructions import Instruction
from stagewise.runtime.executor_state import ExecutorState
from stagewise.runtime.failure_notice import PeerFailed
from stagewise.runtime.threads import Countdown
from stagewise.runtime.transport import StepOutcome, describe_failure

GRACE_S = 0.5  # after a deadline, how long threads get to notice the failure before they count as stuck
RECOVER = "sw.load the last checkpoint, or compile the model again"
ROLLED_BACK = ("the step was rolled back: weights, gradients, optimizer state, buffers, RNG and memory "
               "pools are as before it, so training may go on")


@dataclass(frozen=True)
class StuckStep:
    """A failed step whose threads had not all returned when `step` gave up on them."""

    step: int
    finished: Countdown
    running: str  # the instructions that were still running


class StepRecovery:
    """The failure path of a step, and the checks before the next, over the executor's state."""

    def __init__(self, state: ExecutorState):
        self.state = state
        self.broken: str | None = None  # why the pipeline cannot train on, once it cannot
        self.stuck: StuckStep | None = None  # a failed step whose threads have not all returned yet

    def settle(self, broken_ok: bool = False) -> None:
        """Before a step, a save or reading the state: finish rolling back a stuck step whose threads
        have returned; `PipelineBrokenError` while they have not, or (unless `broken_ok`) once the
        pipeline is broken."""
        if self.broken is not None and not broken_ok:
            raise PipelineBrokenError(self.broken)
        stuck = self.stuck
        if stuck is None:
            return
        if not stuck.finished.done():
            raise PipelineBrokenError(
                f"step {stuck.step} passed its deadline while `{stuck.running}` was running user code, which "
                "has not returned yet: the pipeline cannot step or save until it does (then that step is "
                f"rolled back and training may go on). If it never returns, {RECOVER}")
        self.stuck = None
        rollback_error = self._roll_back(stuck.step)
        if rollback_error is not None and not broken_ok:
            raise PipelineBrokenError(self.broken) from rollback_error

    def handle_failure(self, failed: BaseException | None, outcome: StepOutcome | None) -> BaseException:
        """Undo the failed step (or leave it to `settle` while a thread is stuck); the exception to
        raise: this process's own, or `StepFailedError` where only a peer failed."""
        step = self.state.iteration + 1
        own = failed if not isinstance(failed, PeerFailed) else None  # PeerFailed: a peer's notice stopped this rank
        error = own if own is not None else StepFailedError(
            f"step {step} failed on another rank ({outcome.failure if outcome else 'unknown'}); it was rolled "
            "back on this rank too")
        self.state.guard.restore_rng()
        if outcome is None:
            self._break(step, "the ranks could not agree whether the step completed")
        if self.state.unfinished is not None:
            self.stuck = StuckStep(step, self.state.unfinished, self.running_labels() or "an instruction")
            error.add_note(f"stagewise: `{self.stuck.running}` is still running; the pipeline cannot step or save "
                           "until it returns, then the step is rolled back")
            return error
        self._roll_back(step)
        error.add_note(f"stagewise: {self.broken if self.broken is not None else ROLLED_BACK}")
        return error

    def _roll_back(self, step: int) -> BaseException | None:
        """Every thread returned: drain the transport and undo the step; the error that stopped the
        rollback, if one did (the pipeline is then broken)."""
        try:
            for device_streams in self.state.streams.values():
                device_streams.end_step()
            self.state.transport.drain()
            self.state.guard.roll_back()
        except BaseException as error:  # noqa: BLE001 - the pipeline is broken; the caller raises
            self._break(step, f"its rollback failed ({describe_failure(error)})")
            return error
        return None

    def _break(self, step: int, why: str) -> None:
        if self.broken is None:
            self.broken = (f"the pipeline is broken since step {step}: {why}, so its state may differ from "
                           f"every state training passed through. To go on, {RECOVER}")

    def blame(self, error: BaseException, device: int, index: int, ins: Instruction) -> None:
        """Note on `error` where it was raised: device, stage, microbatch and instruction."""
        microbatch = getattr(ins, "microbatch", None)
        part = f"microbatch {microbatch}" if microbatch is not None else "no microbatch (a per-step instruction)"
        error.add_note(f"stagewise: raised on device {device}, stage {ins.stage}, {part}, "
                       f"by `{self.state.tables[device].labels[index]}`")

    def timeout_error(self) -> StepTimeoutError:
        """The error of a step that passed its deadline, naming what was running."""
        running = self.running_labels()
        what = (f"`{running}` was still running" if running else
                "no instruction was running (every stream waited)")
        return StepTimeoutError(
            f"step {self.state.iteration + 1} did not finish within timeout_s={self.state.timeout_s:g} s: {what}. If that "
            "stage is only slow, raise pipe.timeout_s; if it hangs, fix the code it runs")

    def running_labels(self) -> str:
        """The instructions that started and have not finished, by label."""
        step, tables = self.state.step, self.state.tables
        labels = [tables[device].labels[index] for device, started in step.started.items()
                  for index, began in enumerate(started) if began and not step.done[device][index]]
        return "`, `".join(labels)
