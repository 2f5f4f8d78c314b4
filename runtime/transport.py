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
        self._sync: Sync | None = None
        self.mailbox: dict[tuple, torch.Tensor] = {}
        self.receiver: dict[tuple, MemoryPool] = {}  # a message's key -> the pool its buffer came from
        self.reductions: dict[tuple, dict[int, list[torch.Tensor]]] = {}
        self.taken: dict[tuple, set[int]] = {}
        self.transfer_specs: dict | None = None  # this step's sizes of what is sent: in memory, never needed
        self.waiting: dict[tuple, tuple[torch.Tensor, int, str]] = {}  # messages waiting for room: tensor, receiver, send
        for pool in pools:
            pool.freed = self._freed

    def send(self, key: tuple, src_device: int, dst_device: int, tensor: torch.Tensor, instruction: str) -> None:
        """key = (what, value, microbatch, src stage, dst stage). A message whose buffer does not fit its
        receiver's pool now (it came before the receiver freed memory: a sender ran ahead, or `memory=` is
        tighter than the plan) waits, never the sender: the release that makes room posts it."""
        pool = self.pools[dst_device]
        self.pools[src_device].count_sent(tensor.numel() * tensor.element_size())
        if pool.try_allocate("buffer", ("buffer",) + key, tensor.numel() * tensor.element_size()):
            self._post(key, pool, tensor)
            return
        _finish_on_gpu(tensor)  # whichever thread posts it later reads it ready
        sync = self._monitor()
        with sync.locked():
            self.waiting[key] = (tensor.detach(), dst_device, instruction)
        self._admit(dst_device)  # a release between the try and now made room without seeing it waiting

    def _post(self, key: tuple, pool: MemoryPool, tensor: torch.Tensor) -> None:
        """Copy the message into a transfer buffer its receiver's pool holds for it, and post it."""
        buffer = pool.take_buffer(tensor, ("buffer",) + key, "post a message")  # held already: takes no room
        buffer.copy_(tensor.detach(), non_blocking=True)  # detached: autograd records nothing
        if buffer.is_cuda or tensor.is_cuda:
            _finish_on_gpu(tensor, buffer)
        sync = self._monitor()
        with sync.locked():  # any thread may send (a forward run early, a threadless stream)
            self.mailbox[key] = buffer
            self.receiver[key] = pool
            sync.changed(("message", key))

    def _admit(self, device: int) -> None:
        """Post the messages waiting for room on `device`, in the order they came, while they fit."""
        pool, sync = self.pools[device], self.sync
        while sync is not None:
            with sync.locked():
                key = next((k for k, (_, d, _) in self.waiting.items() if d == device), None)
                if key is None:
                    return
                tensor = self.waiting[key][0]
                if not pool.try_allocate("buffer", ("buffer",) + key, tensor.numel() * tensor.element_size()):
                    return
                del self.waiting[key]
            self._post(key, pool, tensor)

    def _freed(self, device: int) -> None:
        """A pool released memory: the messages waiting for room on that device may fit now."""
        if self.waiting:
            self._admit(device)

    def _no_room(self) -> CapacityError | None:
        """Where the programs deadlock with a message still waiting for room (`Sync.explain`): nothing will
        free it, and the error names the receiver and the bytes."""
        for tensor, device, instruction in self.waiting.values():
            shortfall = self.pools[device].shortfall("buffer", tensor.numel() * tensor.element_size(), instruction)
            return CapacityError(f"{shortfall}, and no instruction will free memory before it must arrive. Give "
                                 "the device more memory, or let compile plan for its limit (leave schedule, "
                                 "microbatches and activations to it).")
        return None

    @property
    def sync(self) -> Sync | None:
        """The running step's monitor (the executor installs one at each launch); told to name a message
        waiting for memory where the programs deadlock."""
        return self._sync

    @sync.setter
    def sync(self, sync: Sync | None) -> None:
        self._sync = sync
        if sync is not None:
            sync.explain = self._no_room

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
        self.waiting.clear()
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
