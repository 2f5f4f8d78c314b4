"""Moving tensors between the stages of one process: mailboxes and all-reduce.

A send copies the tensor into a transfer buffer taken from the receiver's memory pool
(the device-to-device copy), and never blocks on its receiver; a receive and an all-reduce
wait, through the shared `Sync` monitor, until their partner has arrived (`arrived` and `poll`
tell without waiting: Varuna's opportunistic policy runs a forward early if its message is
here). On CUDA a message or a contribution is published only once its copy has finished on
the GPU (the sending stream's thread waits, not its compute), so the partner may use it on any
of its streams. Messages are keyed by stage, so two stages on one device (interleaved
schedules) exchange through the same mechanism.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, cast

import torch

from stagewise.ir.errors import CapacityError
from stagewise.runtime.pool import MemoryPool
from stagewise.runtime.sync import Sync


@dataclass(frozen=True)
class StepOutcome:
    """How a step ended on every rank, as `conclude` agreed it: the total loss when every rank
    succeeded, else `failure`, a description of which rank failed and how (under torch.distributed
    a rank whose own threads succeeded learns here that a peer failed)."""

    loss: torch.Tensor | None
    failure: str | None


def describe_failure(error: BaseException) -> str:
    """One line naming an exception, its message and the note saying where it was raised."""
    notes = getattr(error, "__notes__", ())
    where = f" ({notes[-1]})" if notes else ""
    return f"{type(error).__name__}: {error}{where}"


class Transport(Protocol):
    """What the executor calls on its transport: `LocalTransport` in one process, `DistributedTransport`
    (runtime/distributed.py) under torch.distributed."""

    pools: list[MemoryPool]
    sync: Sync | None  # the running step's monitor, which the executor installs at each launch

    @property
    def adopts_receives(self) -> bool: ...  # any thread may receive (Varuna's policy may take one over)

    @property
    def in_memory(self) -> bool: ...  # a receive whose message arrived returns at once (threadless streams)

    def send(self, key: tuple, src_device: int, dst_device: int, tensor: torch.Tensor, instruction: str) -> None: ...
    def recv(self, key: tuple, instruction: str) -> torch.Tensor: ...
    def arrived(self, key: tuple) -> bool: ...
    def poll(self, key: tuple, instruction: str) -> bool: ...
    def all_reduce(self, tag: tuple, group: tuple[int, ...], rank: int, tensors: list[torch.Tensor],
                   instruction: str) -> list[torch.Tensor]: ...
    def notify_failure(self, error: BaseException) -> None: ...
    def conclude(self, partial: torch.Tensor | None, failed: BaseException | None) -> StepOutcome: ...
    def drain(self) -> None: ...


class LocalTransport:
    def __init__(self, pools: list[MemoryPool]):
        self.pools = pools
        self.sync: Sync | None = None
        self.mailbox: dict[tuple, torch.Tensor] = {}
        self.receiver: dict[tuple, MemoryPool] = {}  # a message's key -> the pool its buffer came from
        self.reductions: dict[tuple, dict[int, list[torch.Tensor]]] = {}
        self.taken: dict[tuple, set[int]] = {}
        self.transfer_specs: dict | None = None  # this step's sizes of what is sent: in memory, never needed
        self.waiting_for_room = 0  # sends waiting for their receiver to free memory (`_wait_for_room`)
        for pool in pools:
            pool.freed = self._freed

    def send(self, key: tuple, src_device: int, dst_device: int, tensor: torch.Tensor, instruction: str) -> None:
        """key = (what, value, microbatch, src stage, dst stage)."""
        pool = self.pools[dst_device]
        if not pool.try_allocate("buffer", ("buffer",) + key, tensor.numel() * tensor.element_size()):
            self._wait_for_room(pool, ("buffer",) + key, tensor.numel() * tensor.element_size(), instruction)
        buffer = pool.take_buffer(tensor, ("buffer",) + key, instruction)
        buffer.copy_(tensor.detach(), non_blocking=True)  # detached: autograd records nothing
        if buffer.is_cuda or tensor.is_cuda:
            _finish_on_gpu(tensor, buffer)
        self.pools[src_device].count_sent(tensor.numel() * tensor.element_size())
        sync = self._monitor()
        with sync.locked():  # any thread may send (a forward run early, a threadless stream)
            self.mailbox[key] = buffer
            self.receiver[key] = pool
            sync.changed(("message", key))

    def _wait_for_room(self, pool: MemoryPool, key: tuple, nbytes: int, instruction: str) -> None:
        """A message that comes before its receiver freed the memory for it (the run's timing is not the
        plan's; a user's `memory=` may be tighter than the plan) waits until the receiver has; where
        nothing will free it (every thread waits), the step fails with a CapacityError naming the
        receiver and the bytes instead of hanging."""
        sync = self._monitor()

        def stuck() -> CapacityError:
            return CapacityError(f"{pool.shortfall('buffer', nbytes, instruction)}, and no instruction will free "
                                 "memory before it arrives. Give the device more memory, or let compile plan "
                                 "for its limit (leave schedule, microbatches and activations to it).")
        with sync.locked():
            self.waiting_for_room += 1
        try:
            sync.wait_until(lambda: pool.try_allocate("buffer", key, nbytes),
                            f"`{instruction}` (memory on device {pool.index})", (("room", pool.index),), stuck)
        finally:
            with sync.locked():
                self.waiting_for_room -= 1

    def _freed(self, device: int) -> None:
        """A pool released memory: a message waiting for room on that device looks again."""
        sync = self.sync
        if self.waiting_for_room and sync is not None:
            with sync.locked():
                sync.changed(("room", device))

    def recv(self, key: tuple, instruction: str) -> torch.Tensor:
        sync = self._monitor()
        with sync.locked():
            buffer = self._take(key)
        if buffer is not None:
            return buffer
        sync.wait_until(lambda: key in self.mailbox, instruction, (("message", key),))
        with sync.locked():
            del self.receiver[key]
            return self.mailbox.pop(key)

    def _monitor(self) -> Sync:
        """The running step's monitor: the transport moves tensors only inside a step."""
        if self.sync is None:
            raise RuntimeError("the transport was used outside a step: the executor installs its monitor at launch")
        return self.sync

    def _take(self, key: tuple) -> torch.Tensor | None:
        """The message under `key` out of the mailbox, if it is there (caller holds the lock)."""
        buffer = self.mailbox.pop(key, None)
        if buffer is not None:
            del self.receiver[key]
        return buffer

    # Varuna's opportunistic policy looks at messages before their receive's turn (runtime/opportunistic.py).
    adopts_receives = True  # any thread may receive a message, and may look first
    # A receive whose message `arrived` returns at once, so threadless streams may run it (runtime/threadless.py).
    in_memory = True

    def arrived(self, key: tuple) -> bool:
        """Whether the message under `key` is here (a receive would not wait). Never blocks, takes no
        lock (the executor asks under the monitor's), changes nothing."""
        return key in self.mailbox

    def poll(self, key: tuple, instruction: str) -> bool:
        """`arrived`, asked by the thread that will receive `key` (under torch.distributed this posts the
        receive ahead of its turn, to learn whether the message came)."""
        return key in self.mailbox

    # ---- the end of a step (the interface DistributedTransport implements across ranks) ---------
    def notify_failure(self, error: BaseException) -> None:
        """A thread of this process failed: in one process `Sync` already stops the others."""

    def conclude(self, partial: torch.Tensor | None, failed: BaseException | None) -> StepOutcome:
        """In one process every last stage is local: the partial sum is the total, and this
        process's failure is the only one."""
        if failed is not None:
            return StepOutcome(loss=None, failure=describe_failure(failed))
        return StepOutcome(loss=partial, failure=None)

    def drain(self) -> None:
        """After a failed step: nothing stays in flight. Undelivered messages give their transfer
        buffers back to the receivers' pools; half-done all-reduces are forgotten."""
        for key, buffer in self.mailbox.items():
            self.receiver[key].give_back_buffer(buffer, ("buffer",) + key)
        self.mailbox.clear()
        self.receiver.clear()
        self.reductions.clear()
        self.taken.clear()

    def all_reduce(self, tag: tuple, group: tuple[int, ...], rank: int, tensors: list[torch.Tensor], instruction: str) -> list[torch.Tensor]:
        """Sum `tensors` over the group members (in group order, so every member gets the same bits)."""
        key = (tag, group)
        _finish_on_gpu(*tensors)
        sync = self._monitor()
        with sync.locked():
            self.reductions.setdefault(key, {}).setdefault(rank, [t.detach() for t in tensors])
            sync.changed(("all-reduce", key))
        sync.wait_until(lambda: len(self.reductions.get(key, {})) == len(group), instruction, [("all-reduce", key)])
        with sync.locked():
            contributions = self.reductions[key]
            device = tensors[0].device if tensors else torch.device("cpu")
            # a group is never empty, so each sum is a tensor (Python's sum, from 0, as every member adds)
            result = [cast(torch.Tensor, sum(contributions[r][i].to(device) for r in group))
                      for i in range(len(tensors))]
            taken = self.taken.setdefault(key, set())
            taken.add(rank)
            if taken == set(group):
                del self.reductions[key], self.taken[key]
        return result


def _finish_on_gpu(*tensors: torch.Tensor) -> None:
    """Block this thread until the work its streams issued on these tensors' devices is done."""
    for device in {t.device for t in tensors if t.is_cuda}:
        torch.cuda.current_stream(device).synchronize()
