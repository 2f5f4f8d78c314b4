"""A step-scoped guard: what this process must put back when a step fails on any stage.

At the start of a step it records what is cheap to record (the global RNG states, each pool's
ledger, each stage's references and buffers: runtime/undo.py) and queues the undo record of each
trained stage resident on a GPU on a side stream (it overlaps the step); right before each
stage's optimizer step it takes the rest of that stage's undo record. A step that completes drops the records
(their memory is kept for the next one). A failed step, once every stream thread has stopped
and the transport is drained, is rolled back: every stage's per-step state is cleared and its
gradients are None (as between steps), updates are undone, swapped stages return to their
between-steps placement (weights and optimizer state in host memory only), buffers, RNG and
the pools' accounting are as before the step.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import TYPE_CHECKING

import torch

from stagewise.runtime.pool import Ledger, MemoryPool
from stagewise.runtime.undo import StageStart, UpdateUndo, clear_step, restore_stage

if TYPE_CHECKING:
    from stagewise.runtime.worker import StageWorker


class RngState:
    """The global torch generators: the CPU one and, once CUDA is initialized, every device's."""

    def __init__(self) -> None:
        self.cpu = torch.get_rng_state()
        self.cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state_all(self.cuda)


def _records_early(worker: StageWorker, start: StageStart) -> bool:
    """A trained stage on a GPU whose weights stay there and are updated there: nothing but its update
    writes them during the step (a swapped or host-updated stage's device weights are refreshed from
    host copies mid-step, so its record waits for the update)."""
    return (worker.optimizer is not None and worker.device.type == "cuda" and not start.host
            and not start.on_host)


class StepGuard:
    """Records before and during a step of `workers` (by stage) on `pools`; rolls it back on failure."""

    def __init__(self, workers: dict[int, StageWorker], pools: list[MemoryPool]):
        self.workers = workers
        self.pools = pools
        self.buffer_copies: dict[int, dict[str, torch.Tensor]] = {stage: {} for stage in workers}
        self.undo = {stage: UpdateUndo() for stage in workers}
        self.recorded: set[int] = set()  # stages whose undo record this step holds
        self.early: set[int] = set()  # stages whose GPU tensors' record the step's start queued
        self.starts: dict[int, StageStart] = {}
        self.ledgers: list[Ledger] = []
        self.rng: RngState | None = None
        self.side_streams: dict[torch.device, torch.cuda.Stream] = {}  # a GPU's undo records' stream

    def begin(self, updated: Collection[int]) -> None:
        """Record the state before the step (its inputs not yet given to the workers); the undo records
        of the `updated` stages resident on a GPU are queued (a forward-only pass updates none)."""
        self.rng = RngState()
        self.ledgers = [pool.ledger() for pool in self.pools]
        self.starts = {stage: StageStart(worker, self.buffer_copies[stage]) for stage, worker in self.workers.items()}
        self.recorded.clear()
        self.early = {stage for stage in updated if stage in self.workers
                      and _records_early(self.workers[stage], self.starts[stage])}
        for stage in self.early:
            self.undo[stage].record_early(self.starts[stage], self._side_stream(self.workers[stage].device))

    def before_update(self, stage: int) -> None:
        """The stage's undo record, right before its optimizer step (once per step), or the
        update ordered after the record the step's start queued."""
        if stage in self.recorded:
            return
        self.recorded.add(stage)
        if stage in self.early:
            self.undo[stage].before_update(self.starts[stage], self.workers[stage].device)
        else:
            self.undo[stage].record(self.starts[stage])

    def _side_stream(self, device: torch.device) -> torch.cuda.Stream:
        """The GPU's stream for undo records; it starts after what the caller queued before the step."""
        stream = self.side_streams.get(device)
        if stream is None:
            stream = self.side_streams[device] = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        return stream

    def commit(self) -> None:
        """The step completed on every stage: the records are not needed (their memory is kept)."""
        for stage in self.recorded | self.early:
            self.undo[stage].forget()
        self.recorded.clear()
        self.early = set()
        self.starts, self.ledgers, self.rng = {}, [], None

    def restore_rng(self) -> None:
        """The global generators as before the step (done as soon as the step fails)."""
        if self.rng is not None:
            self.rng.restore()

    def roll_back(self) -> None:
        """Put every stage and pool back as before the step (every stream thread has stopped and
        the transport is drained)."""
        if torch.cuda.is_initialized():
            torch.cuda.synchronize()  # the records' copies (queued on the streams) are complete
        for stage, worker in self.workers.items():
            clear_step(worker)
            restore_stage(worker, self.starts[stage], self.undo[stage])  # an unrecorded undo holds nothing
        for pool, ledger in zip(self.pools, self.ledgers, strict=True):
            pool.restore(ledger)
        self.commit()
