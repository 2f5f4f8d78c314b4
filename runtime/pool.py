"""The unified memory pool of one device (Harmony §4.4).

Every runtime-managed tensor is registered here under a kind (weights, grads, optimizer,
stash, buffer, swapped-in state) whatever stream made it, so one ledger enforces the device's
capacity, records the peak, and counts swap and p2p traffic. Transfer buffers are recycled:
a receive takes a free buffer of the same shape and dtype if one was released, so steady-state
iterations allocate no new transfer memory.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

import torch

from stagewise.ir.devices import format_bytes
from stagewise.ir.errors import CapacityError

KINDS = ("weights", "buffers", "grads", "optimizer", "stash", "buffer")


@dataclass(frozen=True)
class Ledger:
    """A pool's accounting at one moment (between steps), to put back after a failed step."""

    held: dict[tuple, tuple[str, int]]
    by_kind: dict[str, int]
    current: int
    peak: int
    swap_in_bytes: int
    swap_out_bytes: int
    swapped: dict[str, int]
    p2p_bytes: int
    reused_buffers: int


class MemoryPool:
    """One device's ledger. Any stream's thread may allocate, release and count here, so every
    change goes through a method that holds `lock`."""

    def __init__(self, device_index: int, device: torch.device, capacity: int | None):
        self.index = device_index
        self.device = device
        self.capacity = capacity
        self.lock = threading.Lock()
        self.held: dict[tuple, tuple[str, int]] = {}  # key -> (kind, bytes)
        self.by_kind: dict[str, int] = defaultdict(int)
        self.current = 0
        self.peak = 0
        self.swap_in_bytes = 0
        self.swap_out_bytes = 0
        self.swapped: dict[str, int] = defaultdict(int)  # bytes moved per kind: weights, grads, optimizer, stash
        self.p2p_bytes = 0
        # (buffer, on CUDA the event after its last use); reused only once that use is done
        self.free_buffers: dict[tuple, list[tuple[torch.Tensor, torch.cuda.Event | None]]] = defaultdict(list)
        self.reused_buffers = 0
        self.freed: Callable[[int], None] | None = None  # told this device's index after every release

    def allocate(self, kind: str, key: tuple, nbytes: int, instruction: str) -> None:
        if not self.try_allocate(kind, key, nbytes):
            raise CapacityError(
                f"{self.shortfall(kind, nbytes, instruction)}. Give the device more memory, use more devices or "
                "fewer microbatches in flight (schedule='1f1b'), or let compile plan swapping."
            )

    def try_allocate(self, kind: str, key: tuple, nbytes: int) -> bool:
        """`allocate` where the device has room; else False, and nothing held under `key`."""
        with self.lock:
            held = self.held.get(key)
            if held is not None:
                if held[1] == nbytes and held[0] == kind:
                    return True  # unchanged (a stage's gradients after every backward but the first): nothing moves
                self._release(key)
            if self.capacity is not None and self.current + nbytes > self.capacity:
                return False
            self.held[key] = (kind, nbytes)
            self.by_kind[kind] += nbytes
            self.current += nbytes
            self.peak = max(self.peak, self.current)
            return True

    def shortfall(self, kind: str, nbytes: int, instruction: str) -> str:
        """What `nbytes` more of `kind` at `instruction` would exceed: the device, what it holds, its capacity."""
        with self.lock:
            return (f"device {self.index} ({self.device}) needs {format_bytes(nbytes)} more for {kind} at "
                    f"`{instruction}` but already holds {format_bytes(self.current)} of its "
                    f"{format_bytes(self.capacity or 0)} ({self._breakdown()})")

    def release(self, key: tuple) -> None:
        with self.lock:
            self._release(key)
        if self.freed is not None:
            self.freed(self.index)

    def _release(self, key: tuple) -> None:
        kind, nbytes = self.held.pop(key, (None, 0))
        if kind is not None:
            self.by_kind[kind] -= nbytes
            self.current -= nbytes

    def take_buffer(self, like: torch.Tensor, key: tuple, instruction: str) -> torch.Tensor:
        """A transfer buffer shaped like `like` on this device, recycled when one is free."""
        self.allocate("buffer", key, like.numel() * like.element_size(), instruction)
        with self.lock:
            free = self.free_buffers[(tuple(like.shape), like.dtype)]
            if free:
                self.reused_buffers += 1
                buffer, last_use = free.pop()
                if last_use is not None:  # the caller's stream writes only after the last reader is done
                    torch.cuda.current_stream(self.device).wait_event(last_use)
                return buffer
        return torch.empty(like.shape, dtype=like.dtype, device=self.device)

    def give_back_buffer(self, buffer: torch.Tensor, key: tuple) -> None:
        """`buffer` may be reused; on CUDA after the work the calling stream issued on it so far."""
        self.release(key)
        last_use = None
        if buffer.is_cuda:
            last_use = torch.cuda.Event()
            last_use.record(torch.cuda.current_stream(buffer.device))
        with self.lock:
            self.free_buffers[(tuple(buffer.shape), buffer.dtype)].append((buffer.detach(), last_use))

    def count_swap_out(self, what: str, nbytes: int) -> None:
        """`nbytes` of `what` (weights, grads, optimizer, stash) copied to host memory; any stream may count."""
        with self.lock:
            self.swap_out_bytes += nbytes
            self.swapped[what] += nbytes

    def count_swap_in(self, what: str, nbytes: int) -> None:
        """`nbytes` of `what` brought back from host memory; any stream may count."""
        with self.lock:
            self.swap_in_bytes += nbytes
            self.swapped[what] += nbytes

    def count_sent(self, nbytes: int) -> None:
        """`nbytes` sent from this device to another; the compute and p2p_out streams both send."""
        with self.lock:
            self.p2p_bytes += nbytes

    def ledger(self) -> Ledger:
        """The accounting now: what is held, and every counter `stats` reports."""
        with self.lock:
            return Ledger(dict(self.held), dict(self.by_kind), self.current, self.peak, self.swap_in_bytes,
                          self.swap_out_bytes, dict(self.swapped), self.p2p_bytes, self.reused_buffers)

    def restore(self, ledger: Ledger) -> None:
        """Account as at `ledger` (a failed step is undone: what it held and moved never happened)."""
        with self.lock:
            self.held = dict(ledger.held)
            self.by_kind = defaultdict(int, ledger.by_kind)
            self.swapped = defaultdict(int, ledger.swapped)
            self.current, self.peak, self.p2p_bytes = ledger.current, ledger.peak, ledger.p2p_bytes
            self.swap_in_bytes, self.swap_out_bytes = ledger.swap_in_bytes, ledger.swap_out_bytes
            self.reused_buffers = ledger.reused_buffers

    def stats(self) -> dict[str, int | None]:  # capacity_bytes: None where the device has no limit
        with self.lock:
            return {
                "device": self.index,
                "peak_bytes": self.peak,
                "current_bytes": self.current,
                "capacity_bytes": self.capacity,
                "swap_in_bytes": self.swap_in_bytes,
                "swap_out_bytes": self.swap_out_bytes,
                "p2p_bytes": self.p2p_bytes,
                "reused_buffers": self.reused_buffers,
                **{f"swap_{kind}_bytes": self.swapped[kind] for kind in ("weights", "grads", "optimizer", "stash")},
                **{f"{kind}_bytes": self.by_kind[kind] for kind in KINDS},
            }

    def _breakdown(self) -> str:
        return ", ".join(f"{k} {format_bytes(v)}" for k, v in self.by_kind.items() if v)


def nbytes(tensors) -> int:
    """Bytes of distinct storages among `tensors` (views of one storage count once)."""
    seen, total = set(), 0
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            ptr = t.untyped_storage().data_ptr()
            if ptr not in seen:
                seen.add(ptr)
                total += t.untyped_storage().nbytes()
    return total
