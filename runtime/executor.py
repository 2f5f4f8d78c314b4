"""Run the devices' instruction programs for one training iteration, in one process.

Every device has a program counter. The executor runs each device's program until it
reaches an instruction that cannot proceed yet (a receive whose message has not been sent,
an all-reduce some member has not reached), then moves to the next device. If a whole round
makes no progress the programs are inconsistent: that is reported, never waited on.
"""

from __future__ import annotations

import math

import torch
from stagewise.compiler.errors import PlanError
from stagewise.compiler.ir import Instruction, Program
from stagewise.runtime.transport import LocalTransport
from stagewise.runtime.worker import StageWorker


class InProcessExecutor:
    def __init__(self, programs: tuple[Program, ...], workers: list[StageWorker], transport: LocalTransport, clip_grad_norm: float | None):
        self.programs = programs
        self.workers = {w.stage.device: w for w in workers}
        self.transport = transport
        self.clip_grad_norm = clip_grad_norm
        self.iteration = 0

    def run(self, microbatches: int) -> torch.Tensor:
        """One iteration; inputs must already be provided to the workers. Returns the mean loss."""
        self.microbatches = microbatches
        counters = {p.device: 0 for p in self.programs}
        pending = {p.device: p for p in self.programs}
        while pending:
            progressed = False
            for device, program in list(pending.items()):
                while counters[device] < len(program.instructions):
                    if not self._execute(device, program.instructions[counters[device]]):
                        break
                    counters[device] += 1
                    progressed = True
                if counters[device] == len(program.instructions):
                    del pending[device]
            if pending and not progressed:
                stuck = "; ".join(f"dev{d}: {p.instructions[counters[d]]}" for d, p in pending.items())
                raise PlanError(f"the device programs wait on each other forever (deadlock): {stuck}")
        self.iteration += 1
        last = next(w for w in self.workers.values() if w.is_last)
        loss = sum(last.losses[mb].detach() for mb in range(microbatches)) / microbatches
        last.losses.clear()
        return loss

    def _execute(self, device: int, ins: Instruction) -> bool:
        worker = self.workers[device]
        if ins.kind == "compute":
            if ins.phase == "F":
                worker.forward(ins.microbatch)
            elif ins.phase == "B":
                worker.backward(ins.microbatch, 1.0 / self.microbatches)
            else:
                worker.update()
            return True
        if ins.kind == "send":
            for value in ins.values:
                tensor = worker.output(ins.microbatch, value) if ins.what == "act" else worker.take_input_grad(ins.microbatch, value)
                self.transport.send(ins.what, value, ins.microbatch, device, ins.peer, tensor)
            return True
        if ins.kind == "recv":
            keys = [(ins.what, v, ins.microbatch, ins.peer, device) for v in ins.values]
            if not all(k in self.transport.mailbox for k in keys):
                return False
            for value in ins.values:
                tensor = self.transport.recv(ins.what, value, ins.microbatch, ins.peer, device)
                if ins.what == "act":
                    worker.provide(ins.microbatch, value, tensor)
                else:
                    worker.add_output_grad(ins.microbatch, value, tensor)
            return True
        if ins.kind == "allreduce":
            return self._all_reduce(device, worker, ins)
        raise PlanError(f"the in-process runtime cannot execute {ins}")

    def _all_reduce(self, device: int, worker: StageWorker, ins: Instruction) -> bool:
        tag = (self.iteration, ins.what, ins.values)
        if ins.what == "shared-grad":
            names = [worker_name(worker, fqn) for fqn in ins.values]
            result = self.transport.all_reduce(tag, ins.group, device, worker.named_grads(names))
            if result is None:
                return False
            worker.set_grads(names, result)
            return True
        result = self.transport.all_reduce(tag, ins.group, device, [worker.grad_square_sum()])
        if result is None:
            return False
        total_norm = math.sqrt(float(result[0]))
        coefficient = min(self.clip_grad_norm / (total_norm + 1e-6), 1.0)
        worker.scale_grads(torch.tensor(coefficient))
        return True


def worker_name(worker: StageWorker, fqn: str) -> str:
    """The name under which this stage holds the shared tensor known as `fqn`."""
    return worker.shared_names.get(fqn, fqn)
