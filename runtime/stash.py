"""A microbatch's stashed activations, by handle, so they can leave the device between F and B.

Harmony's sX: what autograd saves during a forward goes through saved_tensors_hooks into a
`Stash`, which holds each tensor behind a handle; `to_host` copies every distinct storage
once into (pinned, on CUDA) host buffers and drops the device references, and `to_device`
rebuilds each tensor as the same view of its storage before the backward unpacks it.
"""

from __future__ import annotations

import threading

import torch

from stagewise.ir.errors import PlanError
from stagewise.runtime.pool import nbytes


def storage_of(tensor: torch.Tensor) -> int:
    """The identity of a tensor's storage (views of one storage share it)."""
    return tensor.untyped_storage().data_ptr()


def unpack(saved):
    """saved_tensors_hooks' unpack: the tensor behind a `Stash` handle."""
    return saved.get() if isinstance(saved, _Saved) else saved


class _Saved:
    """One tensor autograd saved for the backward, held by handle: a swap changes what it holds."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: torch.Tensor):
        self.tensor: torch.Tensor | None = tensor

    def get(self) -> torch.Tensor:
        if self.tensor is None:
            raise PlanError("the backward reached a stashed activation still in host memory (no stash-in before it)")
        return self.tensor


class Stash:
    """What one microbatch's forward keeps for its backward: the tensors autograd saved (packed by
    saved_tensors_hooks into `_Saved` handles) and the stage's outputs, less the storages in `kept`
    (the stage's state and the microbatch's inputs, which stay where they are).

    `to_host` copies each distinct storage once to host memory (pinned on CUDA) and drops every
    device reference to it: handles are emptied, outputs point at an empty tensor (the backward
    needs only their autograd history, and gets their data back first). `to_device` copies the
    storages back and rebuilds each member as the same view (dtype, size, stride, offset) of its
    storage, so views that shared memory before share it again. The swap moves exactly the bytes
    the pool counted for the stash (less any storage that cannot move: not on this device, or not
    a plain strided tensor).
    """

    def __init__(self, device: torch.device, kept: set[int]):
        self.device = device
        self.kept = kept
        self.saved: list[_Saved] = []
        self.outputs: list[torch.Tensor] = []
        self.host: dict[int, torch.Tensor] | None = None  # while swapped out: storage -> its bytes on the host
        self.layouts: list[tuple] = []  # while swapped out: (handle or output, storage, dtype, size, stride, offset)
        self._nbytes: int | None = None

    def pack(self, tensor: torch.Tensor):
        if storage_of(tensor) in self.kept:
            return tensor
        handle = _Saved(tensor)
        self.saved.append(handle)
        return handle

    def add_outputs(self, outputs) -> None:
        self.outputs = [o for o in outputs if isinstance(o, torch.Tensor) and storage_of(o) not in self.kept]
        self._nbytes = nbytes([h.tensor for h in self.saved] + self.outputs)

    def release(self) -> None:
        """Let go of the saved tensors and outputs once the backward has run or the step is abandoned.
        Each op that saved a tensor holds `pack`, so this stash, in a saved variable that gc cannot
        see; the stash holds its outputs, which hold those ops, and its handles, which hold tensors
        that may hold their ops too (tanh saves its own output): cycles through C++ that gc cannot
        collect, which would keep the activations and, through their graph, the stage's parameters
        alive for good wherever no backward ran (a failed step) or reached (an unused branch)."""
        for handle in self.saved:
            handle.tensor = None
        self.outputs = []

    @property
    def on_host(self) -> bool:
        return self.host is not None

    def nbytes(self) -> int:
        return self._nbytes or 0

    def device_tensors(self) -> list[torch.Tensor]:
        if self.on_host:
            return []
        return [h.tensor for h in self.saved if h.tensor is not None] + self.outputs

    def _movable(self, tensor: torch.Tensor) -> bool:
        on_device = tensor.device.type == self.device.type and self.device.index in (None, tensor.device.index)
        return (on_device and type(tensor) is torch.Tensor and tensor.layout == torch.strided
                and not (tensor.is_quantized or tensor.is_conj() or tensor.is_neg())
                and tensor.untyped_storage().nbytes() > 0)

    def to_host(self, buffers: HostBuffers) -> int:
        """Copy the stash to host memory and release it on the device; returns the bytes moved."""
        members: dict[int, list[tuple[object, torch.Tensor]]] = {}
        for target, tensor in [(h, h.get()) for h in self.saved] + [(o, o) for o in self.outputs]:
            members.setdefault(storage_of(tensor), []).append((target, tensor))
        self.host, self.layouts, moved = {}, [], 0
        for key, group in members.items():
            if not all(self._movable(t) for _, t in group):
                continue
            storage = group[0][1].untyped_storage()
            host = buffers.take(storage.nbytes())
            host.copy_(torch.empty(0, dtype=torch.uint8, device=self.device).set_(storage), non_blocking=True)
            self.host[key] = host
            moved += storage.nbytes()
            self.layouts += [(target, key, t.dtype, tuple(t.shape), t.stride(), t.storage_offset()) for target, t in group]
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()  # copied before the device memory is let go
        for target, _, dtype, *_ in self.layouts:
            if isinstance(target, _Saved):
                target.tensor = None
            else:  # an output: keeps its autograd history, gives up its data until the swap-in
                target.data = torch.empty(0, dtype=dtype, device=self.device)
        return moved

    def to_device(self, buffers: HostBuffers) -> int:
        """Copy the stash back from host memory (on the calling stream); returns the bytes moved."""
        if self.host is None:
            raise PlanError("a stash-in found its stash on the device already (no stash-out before it)")
        storages, moved = {}, 0
        for key, host in self.host.items():
            device_bytes = torch.empty(host.numel(), dtype=torch.uint8, device=self.device)
            device_bytes.copy_(host, non_blocking=True)
            storages[key] = device_bytes.untyped_storage()
            buffers.give_back(host)
            moved += host.numel()
        for target, key, dtype, size, stride, offset in self.layouts:
            tensor = torch.empty(0, dtype=dtype, device=self.device).set_(storages[key], offset, size, stride)
            if isinstance(target, _Saved):
                target.tensor = tensor
            else:
                target.data = tensor
        self.host, self.layouts = None, []
        return moved


class HostBuffers:
    """Host memory for swapped stashes (pinned on CUDA), recycled: a stage's microbatches stash
    storages of the same sizes, so steady-state swaps allocate no new host memory. On CUDA a
    buffer is reused only after the copy that last read it (an event on that copy's stream)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.pinned = device.type == "cuda"
        self.lock = threading.Lock()
        self.free: dict[int, list[tuple[torch.Tensor, torch.cuda.Event | None]]] = {}

    def take(self, size: int) -> torch.Tensor:
        with self.lock:
            free = self.free.get(size)
            buffer, last_read = free.pop() if free else (None, None)
        if buffer is None:
            return torch.empty(size, dtype=torch.uint8, pin_memory=self.pinned)
        if last_read is not None:
            last_read.synchronize()
        return buffer

    def give_back(self, buffer: torch.Tensor) -> None:
        last_read = None
        if self.pinned:
            last_read = torch.cuda.Event()
            last_read.record(torch.cuda.current_stream(self.device))
        with self.lock:
            self.free.setdefault(buffer.numel(), []).append((buffer, last_read))
