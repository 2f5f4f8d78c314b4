"""The executor's handlers: what each instruction kind does on a stream thread (or, for a
threadless stream, on whichever thread runs it).

Kept apart from the scheduling (which instruction runs when, on which thread, runtime/executor.py):
`InstructionHandlers` reads and writes only the executor's state it is given (runtime/executor_state.py):
the workers, transport, device streams, program tables and the running step's gradient norm.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import ClassVar, cast

import torch

from stagewise.ir.instructions import (
    AllReduceGradNorm,
    AllReduceShared,
    Backward,
    Carried,
    Forward,
    Free,
    GradNormPart,
    HostUpdate,
    InputGrad,
    Instruction,
    Recompute,
    Recv,
    Send,
    StashIn,
    StashOut,
    Stream,
    SwapIn,
    SwapOut,
    Update,
    WeightGrad,
)
from stagewise.ir.interpreter import Interpreter, stashes
from stagewise.runtime.executor_state import ExecutorState
from stagewise.runtime.precision import autocast_for, grad_coefficient, skip_update


class InstructionHandlers(Interpreter):
    """One method per instruction kind, named in `handlers`; `dispatch` runs an instruction with its type's."""

    handlers = {
        Forward: "_forward", Recompute: "_forward", Backward: "_backward", InputGrad: "_backward",
        WeightGrad: "_weight_grad", Update: "_update",
        HostUpdate: "_update", GradNormPart: "_count_norm_part", AllReduceShared: "_all_reduce_shared",
        AllReduceGradNorm: "_all_reduce_norm", Send: "_send", Recv: "_recv",
        SwapIn: "_swap_in", StashIn: "_swap_in", SwapOut: "_swap_out", Free: "_swap_out", StashOut: "_swap_out",
    }

    def __init__(self, state: ExecutorState):
        self.state = state

    def bind(self, device: int, index: int, ins: Instruction) -> Callable[[], None]:
        """The instruction as the call a step makes (once per program, runtime/tables.py): the hot kinds
        (forward, backward, send, receive) with their worker, name in errors and message keys resolved."""
        binder = self.binders.get(type(ins))
        return binder(self, device, index, ins) if binder is not None else super().bind(device, index, ins)

    def _forward(self, device: int, index: int, ins: Forward | Recompute) -> None:
        self._bind_forward(device, index, ins)()

    def _bind_forward(self, device: int, index: int, ins: Forward | Recompute) -> Callable[[], None]:
        state, worker, label = self.state, self.state.workers[ins.stage], self.state.tables[device].labels[index]
        stage, microbatch, recompute, stash = ins.stage, ins.microbatch, isinstance(ins, Recompute), stashes(ins)
        autocast = autocast_for(state.precision, worker.device)  # entered by one forward at a time (torch.autocast
        # keeps what it replaces on itself until it exits): made once, not per call

        def forward() -> None:  # the worker's module is read each time: predict swaps it for a step
            replayed = state.replay.running(stage, worker.module, microbatch, state.iteration, recompute)
            with autocast, replayed:
                worker.forward(microbatch, label, stash=stash)
        return forward

    def _backward(self, device: int, index: int, ins: Backward | InputGrad) -> None:
        self._bind_backward(device, index, ins)()

    def _bind_backward(self, device: int, index: int, ins: Backward | InputGrad) -> Callable[[], None]:
        """A whole backward, or (InputGrad) its input-gradient half: both seed the loss alike."""
        state, worker, label = self.state, self.state.workers[ins.stage], self.state.tables[device].labels[index]
        microbatch, split = ins.microbatch, isinstance(ins, InputGrad)

        def backward() -> None:  # the worker's method is read each time, as forward's (a test may wrap it)
            seed = state.loss_weights.seed(microbatch, state.step.microbatches)
            if state.scaler is not None:  # fp16: the seed scaled, so the gradients stay in fp16's range
                seed *= state.scaler.scale
            (worker.backward_input if split else worker.backward)(microbatch, seed, label)
        return backward

    def _weight_grad(self, device: int, index: int, ins: WeightGrad) -> None:
        """A split backward's weight-gradient half (runtime/split_backward.py)."""
        self.state.workers[ins.stage].backward_weight(ins.microbatch, self.state.tables[device].labels[index])

    def _update(self, device: int, index: int, ins: Update | HostUpdate) -> None:
        """The optimizer step on the device or (HostUpdate) on host masters; `clip` scales first.
        The step's guard first takes the stage's undo record (runtime/rollback.py). A step whose global
        gradient norm (fp16's overflow check, or clipping's) is not finite updates no stage
        (runtime/precision.py; the pipeline warns, compiler/pipeline/step_notices.py)."""
        state = self.state
        worker = state.workers[ins.stage]
        if state.step_overflowed:
            skip_update(worker)
            return
        if worker.optimizer is not None:
            state.guard.before_update(ins.stage)
        worker.update(state.tables[device].labels[index], on_host=isinstance(ins, HostUpdate), clip=ins.clip)

    def _send(self, device: int, index: int, ins: Send) -> None:
        self._bind_send(device, index, ins)()

    def _bind_send(self, device: int, index: int, ins: Send) -> Callable[[], None]:
        state, worker, tables = self.state, self.state.workers[ins.stage], self.state.tables[device]
        label, messages, streams = tables.labels[index], tables.messages[index], state.streams[device]
        microbatch, peer = ins.microbatch, ins.peer
        take = worker.output if ins.carries is Carried.ACTIVATIONS else worker.take_input_grad

        def send() -> None:
            for value, key in messages:
                tensor = take(microbatch, value)
                streams.hand_to([tensor], Stream.P2P_OUT)
                state.transport.send(key, device, peer, tensor, label)

        def send_from_cpu() -> None:  # a CPU device has no streams to hand the tensor between
            for value, key in messages:
                state.transport.send(key, device, peer, take(microbatch, value), label)
        return send if streams.cuda else send_from_cpu

    def _recv(self, device: int, index: int, ins: Recv) -> None:
        self._bind_recv(device, index, ins)()

    def _bind_recv(self, device: int, index: int, ins: Recv) -> Callable[[], None]:
        state, worker, tables = self.state, self.state.workers[ins.stage], self.state.tables[device]
        label, streams, microbatch = tables.labels[index], state.streams[device], ins.microbatch
        # each message's value, transport key and the pool's key of the buffer it arrives in
        messages = [(value, key, ("buffer",) + key) for value, key in tables.messages[index]]
        keep = worker.provide if ins.carries is Carried.ACTIVATIONS else worker.add_output_grad

        def recv() -> None:
            for value, key, buffer_key in messages:
                tensor = state.transport.recv(key, label)
                streams.hand_to([tensor], Stream.COMPUTE)
                keep(microbatch, value, tensor, buffer_key)

        def recv_on_cpu() -> None:
            for value, key, buffer_key in messages:
                keep(microbatch, value, state.transport.recv(key, label), buffer_key)
        return recv if streams.cuda else recv_on_cpu

    def _swap_in(self, device: int, index: int, ins: SwapIn | StashIn) -> None:
        """State (weights, grads, optimizer) or one microbatch's stash into the device pool."""
        worker = self.state.workers[ins.stage]
        what, microbatch = _moved(ins)
        worker.swap_in(what, self.state.tables[device].labels[index], microbatch)
        self.state.streams[device].hand_to(worker.tensors(what, microbatch).values(), Stream.COMPUTE)

    def _swap_out(self, device: int, index: int, ins: SwapOut | Free | StashOut) -> None:
        """Write back (SwapOut, StashOut) or drop (Free) the device copy."""
        worker = self.state.workers[ins.stage]
        what, microbatch = _moved(ins)
        self.state.streams[device].hand_to(worker.tensors(what, microbatch).values(), Stream.SWAP_OUT)
        worker.swap_out(what, not isinstance(ins, Free), self.state.tables[device].labels[index], microbatch)

    def _count_norm_part(self, device: int, index: int, ins: GradNormPart) -> None:
        """This stage's squared gradient norm, counted ahead of the GradNorm all-reduce while its
        gradients are at hand (swapping: they leave the device after); its update then scales."""
        self.state.workers[ins.stage].count_grad_norm()

    def _all_reduce_shared(self, device: int, index: int, ins: AllReduceShared) -> None:
        """Sum the shared tensors' gradients over the group; this device contributes its member stages' sum."""
        state = self.state
        local = [state.workers[s] for s in ins.group if state.device_of[s] == device]
        names = [[w.shared_names.get(fqn, fqn) for fqn in ins.tensors] for w in local]
        grads = [w.named_grads(n) for w, n in zip(local, names, strict=True)]
        # every member stage holds each shared tensor's gradient: each sum is a tensor
        summed = [cast(torch.Tensor, sum(parts)) for parts in zip(*grads, strict=True)]
        tag = (state.iteration, type(ins).__name__, ins.tensors, ins.group)
        result = state.transport.all_reduce(tag, self._devices(ins.group), device, summed, state.tables[device].labels[index])
        for w, n in zip(local, names, strict=True):
            w.set_grads(n, [r.clone() for r in result])

    def _all_reduce_norm(self, device: int, index: int, ins: AllReduceGradNorm) -> None:
        """The whole model's gradient norm; stages counted live scale right away, those whose part was
        counted ahead keep the coefficient for their update. With fp16 the gradients are scaled: the
        norm reported and clipped is the unscaled one. A total that is not finite (the same on every
        device; fp16's overflow, or an inf or NaN in any precision with clipping) skips the step everywhere."""
        state = self.state
        local = [state.workers[s] for s in ins.group if state.device_of[s] == device]
        # the device runs this all-reduce for its member stages, so there is one: the sum is a tensor
        square_sum = cast(torch.Tensor, sum(w.grad_square_sum() if w.norm_part is None else w.norm_part for w in local))
        tag = (state.iteration, type(ins).__name__, (), ins.group)
        (total,) = state.transport.all_reduce(tag, self._devices(ins.group), device, [square_sum],
                                              state.tables[device].labels[index])
        scale = 1.0 if state.scaler is None else state.scaler.scale
        norm = math.sqrt(float(total)) / scale  # every device's all-reduce gives the same total
        state.step_grad_norm, state.step_overflowed = norm, not math.isfinite(norm)
        coefficient = grad_coefficient(norm, state.clip_grad_norm, scale)
        for w in local:
            if state.step_overflowed:
                w.norm_part = None  # its update is skipped
            elif w.norm_part is None:
                w.scale_grads(coefficient)
            else:
                w.norm_part, w.clip_coefficient = None, coefficient

    def _devices(self, group: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(sorted({self.state.device_of[s] for s in group}))

    # the kinds on every microbatch's path, bound with what their handler looks up resolved (`bind`)
    binders: ClassVar[dict[type[Instruction], Callable[..., Callable[[], None]]]] = {
        Forward: _bind_forward, Recompute: _bind_forward, Backward: _bind_backward, InputGrad: _bind_backward,
        Send: _bind_send, Recv: _bind_recv,
    }


def _moved(ins: SwapIn | SwapOut | Free | StashIn | StashOut) -> tuple[str, int | None]:
    """The worker's name for what a swap moves, and the microbatch of a stash."""
    if isinstance(ins, (StashIn, StashOut)):
        return "stash", ins.microbatch
    return ins.state.value, None
