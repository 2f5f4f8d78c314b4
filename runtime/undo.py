"""What one stage needs to be put back as it was before a failed step.

Forwards and backwards never write a stage's weights or optimizer state; only its update does
(and, after it, the swaps that carry the updated values to host memory). So a step records,
per stage:

- at its start, for free, *references*: each parameter's data and each host copy (swapped
  weights, host masters, parked optimizer state), a shallow copy of each parameter's optimizer
  state (an optimizer that replaces a tensor leaves the old one in that copy), and flags; and
  a copy of every buffer (BatchNorm's kernel writes running statistics without bumping their
  `_version`, so a buffer's version cannot tell which ones change: all are copied);
- the *undo record*: a host copy (pinned on CUDA) of every tensor among those references that
  the update or a later swap may write in place. Nothing writes them before the update, so on
  CUDA, where all of a stage's are on its GPU, the copy is queued at the step's start on a side
  stream: it overlaps the forwards and backwards (on an idle PCIe link: free), and the update's
  stream waits for it on the GPU. Elsewhere (CPU stages, host copies of swapped stages) it is
  taken right before the stage's optimizer step.

Putting the stage back (`restore_stage`) writes the undo record into those tensors, then puts
every reference back: a device copy made during the step (a swapped stage's weights or
optimizer state) is dropped, leaving the between-steps placement, and optimizer state a
parameter did not have before is gone. The record's memory is kept for the next step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from stagewise.runtime.worker import StageWorker


class StageStart:
    """A stage's state at the start of a step, by reference, and a copy of its buffers."""

    def __init__(self, worker: StageWorker, buffer_copies: dict[str, torch.Tensor]):
        self.data = {name: param.data for name, param in worker.params.items()}
        self.param_versions = {name: param._version for name, param in worker.params.items()}
        self.host = dict(worker.host)
        optimizer = worker.optimizer
        self.optimizer_state = {p: dict(state) for p, state in optimizer.state.items()} if optimizer else {}
        self.on_host = worker.on_host
        self.master_versions = dict(worker.versions)
        self.newest = list(worker.weight_versions.newest.values())  # 2bw's second version, written in place
        self.buffers = copy_buffers(worker, buffer_copies)

    def writable(self) -> list[torch.Tensor]:
        """The tensors an update (or a swap after it) may write in place: resident weights, host
        copies, 2bw's newest weights, optimizer state (a scalar `step` included); empty placeholders
        hold nothing."""
        tensors = [t for t in self.data.values() if t.numel() > 0]
        tensors += [t for t in self.host.values() if t.numel() > 0] + self.newest
        tensors += [v for state in self.optimizer_state.values() for v in state.values()
                    if isinstance(v, torch.Tensor) and v.numel() > 0]
        return tensors


def copy_buffers(worker: StageWorker, copies: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every buffer of the stage copied into host memory `copies` (reused from step to step). On
    CUDA the copy is queued on the caller's stream, which every stream of the step waits for."""
    for name, buffer in worker.module.named_buffers():
        copy = copies.get(name)
        if copy is None or copy.shape != buffer.shape or copy.dtype != buffer.dtype:
            copy = copies[name] = _host_like(buffer)
        copy.copy_(buffer, non_blocking=True)
    return copies


class UpdateUndo:
    """The undo record of one stage's update: host copies of what it may write, kept in memory
    reused by every step's record. Taken whole right before the update, or in two parts: a stage's
    GPU tensors at the step's start on a side stream, its host tensors (AdamW's `step` counts, say)
    right before the update."""

    def __init__(self) -> None:
        self.pairs: list[tuple[torch.Tensor, torch.Tensor]] = []  # (the live tensor, its copy)
        self.memory: dict[int, torch.Tensor] = {}  # by position in `StageStart.writable()`
        self.copied: torch.cuda.Event | None = None  # set when the side stream's copies are done

    def record(self, start: StageStart, on_gpu: bool | None = None) -> None:
        """Copy what the update may write on the caller's stream: every tensor, or those on a GPU
        (`on_gpu` True) or on the host (False) only."""
        for position, tensor in enumerate(start.writable()):
            if on_gpu is not None and tensor.is_cuda != on_gpu:
                continue
            copy = self.memory.get(position)
            if copy is None or copy.shape != tensor.shape or copy.dtype != tensor.dtype:
                copy = self.memory[position] = _host_like(tensor)
            copy.copy_(tensor, non_blocking=True)
            self.pairs.append((tensor, copy))

    def record_early(self, start: StageStart, side_stream: torch.cuda.Stream) -> None:
        """At the step's start, the GPU tensors' copies queued on `side_stream` (they overlap the
        step: nothing writes them before the update); `before_update` takes the rest."""
        with torch.cuda.stream(side_stream):
            self.record(start, on_gpu=True)
        self.copied = self.copied or torch.cuda.Event()
        self.copied.record(side_stream)

    def before_update(self, start: StageStart, device: torch.device) -> None:
        """The rest of an early record (host tensors); the update, on the caller's current stream of
        `device`, starts after the side stream's copies (on the GPU: the host does not block)."""
        self.record(start, on_gpu=False)
        if self.copied is not None:
            torch.cuda.current_stream(device).wait_event(self.copied)

    def forget(self) -> None:
        self.pairs = []

    def restore(self) -> None:
        """Write the recorded values back (every stream stopped and, on CUDA, synchronized)."""
        with torch.no_grad():
            for tensor, copy in self.pairs:
                tensor.copy_(copy)
        self.pairs = []


def _host_like(tensor: torch.Tensor) -> torch.Tensor:
    return torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=tensor.is_cuda)


def clear_step(worker: StageWorker) -> None:
    """Drop everything a step leaves in the worker between its instructions: inputs, outputs,
    messages (their transfer buffers back to the pool), gradients, stashes, split backwards' weight
    passes (each holding its autograd graph), the clip state."""
    for held in worker.buffers.values():
        for buffer, key in held:
            worker.pool.give_back_buffer(buffer, key)
    for stash in worker.stashes.values():
        stash.release()  # else never freed: runtime/stash.py
    for per_step in (worker.inputs, worker.buffers, worker.outputs, worker.output_grads, worker.input_grads,
                     worker.losses, worker.stashes, worker.weight_passes):
        per_step.clear()
    worker.norm_part, worker.clip_coefficient = None, None
    for param in worker.aliases.values():
        param.grad = None


def restore_stage(worker: StageWorker, start: StageStart, undo: UpdateUndo) -> None:
    """Put the stage back as `start` found it (after `clear_step`; the undo record written back)."""
    undo.restore()
    with torch.no_grad():
        for name, param in worker.params.items():
            param.data = start.data[name]
        for name, buffer in worker.module.named_buffers():
            buffer.copy_(start.buffers[name])
    worker.host.clear()
    worker.host.update(start.host)
    if worker.optimizer is not None:
        worker.optimizer.state.clear()
        worker.optimizer.state.update({p: dict(state) for p, state in start.optimizer_state.items()})
    worker.on_host = start.on_host
    worker.versions.clear()
    worker.versions.update(start.master_versions)
    for name, param in worker.params.items():  # a master current at the start is current again
        if start.master_versions.get(name) == start.param_versions[name]:
            worker.versions[name] = param._version
    worker._note_resident()
