"""The executor's handlers: what each instruction kind does on a stream thread (or, for a
threadless stream, on whichever thread runs it).

A mixin of `StreamExecutor`, kept apart from the scheduling (which instruction runs when, on
which thread): it uses the executor's workers, transport, device streams and program tables.
"""

from __future__ import annotations

import math

from stagewise.ir.instructions import (
    AllReduceGradNorm,
    AllReduceShared,
    Backward,
    Carried,
    Forward,
    Free,
    GradNormPart,
    HostUpdate,
    Recompute,
    Recv,
    Send,
    StashIn,
    StashOut,
    Stream,
    SwapIn,
    SwapOut,
    Update,
)
from stagewise.ir.interpreter import stashes
from stagewise.runtime.precision import autocast_for, grad_coefficient, skip_update


class Handlers:
    """One method per instruction kind, named in `StreamExecutor.handlers`."""

    def _forward(self, device: int, index: int, ins: Forward | Recompute) -> None:
        worker = self.workers[ins.stage]
        with autocast_for(self.precision, worker.device), self.replay.running(ins.stage, worker.module, ins.microbatch, self.iteration, isinstance(ins, Recompute)):
            worker.forward(ins.microbatch, self.tables[device].labels[index], stash=stashes(ins))

    def _backward(self, device: int, index: int, ins: Backward) -> None:
        seed = self.loss_weights.seed(ins.microbatch, self.microbatches)
        if self.scaler is not None:  # fp16: the seed scaled, so the gradients stay in fp16's range
            seed *= self.scaler.scale
        self.workers[ins.stage].backward(ins.microbatch, seed, self.tables[device].labels[index])

    def _update(self, device: int, index: int, ins: Update | HostUpdate) -> None:
        """The optimizer step on the device or (HostUpdate) on host masters; `clip` scales first.
        The step's guard first takes the stage's undo record (runtime/rollback.py). A step whose global
        gradient norm (fp16's overflow check, or clipping's) is not finite updates no stage
        (runtime/precision.py; the pipeline warns, compiler/pipeline/step_notices.py)."""
        if self.step_overflowed:
            skip_update(self.workers[ins.stage])
            return
        if self.workers[ins.stage].optimizer is not None:
            self.guard.before_update(ins.stage)
        self.workers[ins.stage].update(self.tables[device].labels[index], on_host=isinstance(ins, HostUpdate), clip=ins.clip)

    def _send(self, device: int, index: int, ins: Send) -> None:
        worker, tables = self.workers[ins.stage], self.tables[device]
        for value, key in tables.messages[index]:
            if ins.carries is Carried.ACTIVATIONS:
                tensor = worker.output(ins.microbatch, value)
            else:
                tensor = worker.take_input_grad(ins.microbatch, value)
            self.streams[device].hand_to([tensor], Stream.P2P_OUT)
            self.transport.send(key, device, ins.peer, tensor, tables.labels[index])

    def _recv(self, device: int, index: int, ins: Recv) -> None:
        worker, tables = self.workers[ins.stage], self.tables[device]
        for value, key in tables.messages[index]:
            tensor = self.transport.recv(key, tables.labels[index])
            self.streams[device].hand_to([tensor], Stream.COMPUTE)
            if ins.carries is Carried.ACTIVATIONS:
                worker.provide(ins.microbatch, value, tensor, ("buffer",) + key)
            else:
                worker.add_output_grad(ins.microbatch, value, tensor, ("buffer",) + key)

    def _swap_in(self, device: int, index: int, ins: SwapIn | StashIn) -> None:
        """State (weights, grads, optimizer) or one microbatch's stash into the device pool."""
        worker = self.workers[ins.stage]
        what, microbatch = _moved(ins)
        worker.swap_in(what, self.tables[device].labels[index], microbatch)
        self.streams[device].hand_to(worker.tensors(what, microbatch).values(), Stream.COMPUTE)

    def _swap_out(self, device: int, index: int, ins: SwapOut | Free | StashOut) -> None:
        """Write back (SwapOut, StashOut) or drop (Free) the device copy."""
        worker = self.workers[ins.stage]
        what, microbatch = _moved(ins)
        self.streams[device].hand_to(worker.tensors(what, microbatch).values(), Stream.SWAP_OUT)
        worker.swap_out(what, not isinstance(ins, Free), self.tables[device].labels[index], microbatch)

    def _count_norm_part(self, device: int, index: int, ins: GradNormPart) -> None:
        """This stage's squared gradient norm, counted ahead of the GradNorm all-reduce while its
        gradients are at hand (swapping: they leave the device after); its update then scales."""
        self.workers[ins.stage].count_grad_norm()

    def _all_reduce_shared(self, device: int, index: int, ins: AllReduceShared) -> None:
        """Sum the shared tensors' gradients over the group; this device contributes its member stages' sum."""
        local = [self.workers[s] for s in ins.group if self.device_of[s] == device]
        names = [[w.shared_names.get(fqn, fqn) for fqn in ins.tensors] for w in local]
        grads = [w.named_grads(n) for w, n in zip(local, names, strict=True)]
        summed = [sum(parts) for parts in zip(*grads, strict=True)]
        tag = (self.iteration, type(ins).__name__, ins.tensors, ins.group)
        result = self.transport.all_reduce(tag, self._devices(ins.group), device, summed, self.tables[device].labels[index])
        for w, n in zip(local, names, strict=True):
            w.set_grads(n, [r.clone() for r in result])

    def _all_reduce_norm(self, device: int, index: int, ins: AllReduceGradNorm) -> None:
        """The whole model's gradient norm; stages counted live scale right away, those whose part was
        counted ahead keep the coefficient for their update. With fp16 the gradients are scaled: the
        norm reported and clipped is the unscaled one. A total that is not finite (the same on every
        device; fp16's overflow, or an inf or NaN in any precision with clipping) skips the step everywhere."""
        local = [self.workers[s] for s in ins.group if self.device_of[s] == device]
        square_sum = sum(w.grad_square_sum() if w.norm_part is None else w.norm_part for w in local)
        tag = (self.iteration, type(ins).__name__, (), ins.group)
        (total,) = self.transport.all_reduce(tag, self._devices(ins.group), device, [square_sum],
                                             self.tables[device].labels[index])
        scale = 1.0 if self.scaler is None else self.scaler.scale
        self.step_grad_norm = math.sqrt(float(total)) / scale  # every device's all-reduce gives the same total
        self.step_overflowed = not math.isfinite(self.step_grad_norm)
        coefficient = grad_coefficient(self.step_grad_norm, self.clip_grad_norm, scale)
        for w in local:
            if self.step_overflowed:
                w.norm_part = None  # its update is skipped
            elif w.norm_part is None:
                w.scale_grads(coefficient)
            else:
                w.norm_part, w.clip_coefficient = None, coefficient

    def _devices(self, group: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(sorted({self.device_of[s] for s in group}))


def _moved(ins: SwapIn | SwapOut | Free | StashIn | StashOut) -> tuple[str, int | None]:
    """The worker's name for what a swap moves, and the microbatch of a stash."""
    if isinstance(ins, (StashIn, StashOut)):
        return "stash", ins.microbatch
    return ins.state.value, None
