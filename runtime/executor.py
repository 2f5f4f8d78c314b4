"""Run the devices' instruction programs for one iteration: five stream threads per device.

Each stream (compute, swap_in, swap_out, p2p_in, p2p_out) is a thread that runs its
instructions in program order (Harmony §4.4). An instruction first waits for the events it
names (`Instruction.waits`: earlier instructions of other streams of its device), then runs;
receives and all-reduces also wait for their partners. PyTorch releases the GIL inside ops,
so one device's copies and sends overlap its compute and devices compute concurrently.
The executor adds no barrier the programs do not state; `Sync` turns a deadlock, a failed
thread or a silent peer into an error instead of a hang.
"""

from __future__ import annotations

import math
import queue
import threading
import time
import weakref
from collections.abc import Callable

import torch
from stagewise.compiler.errors import PlanError
from stagewise.compiler.ir import STREAMS, Instruction, Program
from stagewise.runtime.streams import DeviceStreams
from stagewise.runtime.sync import Aborted, Sync
from stagewise.runtime.transport import LocalTransport
from stagewise.runtime.worker import StageWorker

DEFAULT_TIMEOUT_S = 300.0


class StreamExecutor:
    def __init__(
        self,
        programs: tuple[Program, ...],
        workers: list[StageWorker],
        transport: LocalTransport,
        clip_grad_norm: float | None,
        device_of: dict[int, int],
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ):
        """`programs` and `workers`: this process's (all of them in one process, one device's under
        torch.distributed); `device_of`: every stage's device, for all-reduce groups."""
        self.programs = programs
        self.workers = {w.stage.index: w for w in workers}
        self.device_of = device_of
        self.transport = transport
        self.clip_grad_norm = clip_grad_norm
        self.timeout_s = timeout_s
        self.iteration = 0
        self.threads = StreamThreads()
        weakref.finalize(self, self.threads.close)
        torch_devices = {w.stage.device: w.device for w in workers}
        self.streams = {p.device: DeviceStreams(torch_devices.get(p.device, torch.device("cpu"))) for p in programs}

    def run(self, microbatches: int) -> torch.Tensor:
        """One iteration; inputs must already be provided to the workers. Returns the mean loss."""
        self.microbatches = microbatches
        streams = [(p, s) for p in self.programs for s in STREAMS if any(i.stream == s for i in p.instructions)]
        self.sync = Sync(len(streams), self.timeout_s)
        self.transport.sync = self.sync
        self.done = {p.device: [False] * len(p.instructions) for p in self.programs}
        self.timeline: list[tuple[int, str, int, float, float]] = []  # measured (device, stream, index, start, end)
        self.started_at = time.perf_counter()
        for device_streams in self.streams.values():
            device_streams.begin_step()
        self.threads.run([((p.device, s), lambda p=p, s=s: self._stream(p, s)) for p, s in streams])
        for device_streams in self.streams.values():
            device_streams.end_step()
        if self.sync.error is not None:
            raise self.sync.error
        self.iteration += 1
        losses = {}
        for worker in self.workers.values():
            if worker.is_last:  # one per data-parallel replica, each with its microbatches
                losses.update({mb: loss.detach() for mb, loss in worker.losses.items()})
                worker.losses.clear()
        partial = sum(losses[mb] for mb in sorted(losses)) if losses else None
        return self.transport.total_loss(partial) / microbatches

    def _stream(self, program: Program, stream: str) -> None:
        """Run this stream's instructions in order; on CUDA each waits for its events on the GPU too."""
        done, streams = self.done[program.device], self.streams[program.device]
        try:
            with streams.running(stream):
                for index, ins in enumerate(program.instructions):
                    if ins.stream != stream:
                        continue
                    label = f"dev{program.device} #{index} {ins}"
                    if ins.waits:
                        self.sync.wait_until(lambda ins=ins: all(done[j] for j in ins.waits), label,
                                             [("done", program.device, j) for j in ins.waits])
                        streams.wait(stream, ins.waits)
                    start = time.perf_counter()
                    self._execute(program.device, ins, label)
                    end = time.perf_counter()
                    streams.record(stream, index)
                    self.timeline.append((program.device, stream, index, start - self.started_at, end - self.started_at))
                    with self.sync.locked():
                        done[index] = True
                        self.sync.changed(("done", program.device, index))
        except Aborted:
            pass
        except BaseException as error:  # noqa: BLE001 - handed to the caller of run()
            self.sync.fail(error)
        finally:
            self.sync.thread_done()

    def _execute(self, device: int, ins: Instruction, label: str) -> None:
        worker = self.workers[ins.stage]
        if ins.kind == "compute":
            if ins.phase in ("F", "R"):
                worker.forward(ins.microbatch, label, stash=ins.what != "no-stash")
            elif ins.phase == "B":
                worker.backward(ins.microbatch, 1.0 / self.microbatches, label)
            else:  # U; what: None, "clip" (scale by the clip coefficient first), "host", "host-clip"
                worker.update(label, on_host=ins.what in ("host", "host-clip"), clip=ins.what in ("clip", "host-clip"))
        elif ins.kind == "send":
            for value in ins.values:
                if ins.what == "act":
                    tensor = worker.output(ins.microbatch, value)
                else:
                    tensor = worker.take_input_grad(ins.microbatch, value)
                key = (ins.what, value, ins.microbatch, ins.stage, ins.peer_stage)
                self.streams[device].hand_to([tensor], "p2p_out")
                self.transport.send(key, device, ins.peer, tensor, label)
        elif ins.kind == "recv":
            for value in ins.values:
                key = (ins.what, value, ins.microbatch, ins.peer_stage, ins.stage)
                tensor = self.transport.recv(key, label)
                self.streams[device].hand_to([tensor], "compute")
                if ins.what == "act":
                    worker.provide(ins.microbatch, value, tensor, ("buffer",) + key)
                else:
                    worker.add_output_grad(ins.microbatch, value, tensor, ("buffer",) + key)
        elif ins.kind == "allreduce":
            self._all_reduce(device, worker, ins, label)
        elif ins.kind == "swap_in":
            worker.swap_in(ins.what, label)
            self.streams[device].hand_to(worker.tensors(ins.what).values(), "compute")
        elif ins.kind in ("swap_out", "free"):
            self.streams[device].hand_to(worker.tensors(ins.what).values(), "swap_out")
            worker.swap_out(ins.what, ins.kind == "swap_out", label)
        else:
            raise PlanError(f"the runtime cannot execute {ins}")

    def _all_reduce(self, device: int, worker: StageWorker, ins: Instruction, label: str) -> None:
        """Sum over the group's stages: this device contributes the sum over its member stages.

        "grad-norm-part" (a group of one stage) counts that stage's squared gradient norm ahead of
        the "grad-norm" all-reduce, while its gradients are at hand (swapping: they leave the
        device after): the grad-norm then sums the parts, and the stage's update ("clip") scales.
        Stages counted live are scaled right away, as without swapping.
        """
        if ins.what == "grad-norm-part":
            worker.count_grad_norm()
            return
        local = [self.workers[s] for s in ins.group if self.device_of[s] == device]
        devices = tuple(sorted({self.device_of[s] for s in ins.group}))
        tag = (self.iteration, ins.what, ins.values, ins.group)
        if ins.what == "shared-grad":
            names = [[w.shared_names.get(fqn, fqn) for fqn in ins.values] for w in local]
            grads = [w.named_grads(n) for w, n in zip(local, names, strict=True)]
            summed = [sum(parts) for parts in zip(*grads, strict=True)]
            result = self.transport.all_reduce(tag, devices, device, summed, label)
            for w, n in zip(local, names, strict=True):
                w.set_grads(n, [r.clone() for r in result])
            return
        square_sum = sum(w.grad_square_sum() if w.norm_part is None else w.norm_part for w in local)
        (total,) = self.transport.all_reduce(tag, devices, device, [square_sum], label)
        coefficient = min(self.clip_grad_norm / (math.sqrt(float(total)) + 1e-6), 1.0)
        for w in local:
            if w.norm_part is None:
                w.scale_grads(coefficient)
            else:
                w.norm_part, w.clip_coefficient = None, coefficient


class StreamThreads:
    """One long-lived thread per (device, stream), started at the first step and reused by every
    later one: starting a dozen threads per step cost more than a small stage's compute."""

    def __init__(self):
        self.queues: dict[tuple[int, str], queue.SimpleQueue] = {}

    def run(self, jobs: list[tuple[tuple[int, str], Callable[[], None]]]) -> None:
        """Run each job on its stream's thread, all at once; return when every job has returned."""
        finished = threading.Semaphore(0)
        for key, job in jobs:
            if key not in self.queues:
                self.queues[key] = queue.SimpleQueue()
                threading.Thread(target=_serve, args=(self.queues[key],), name=f"dev{key[0]}-{key[1]}", daemon=True).start()
            self.queues[key].put((job, finished))
        for _ in jobs:
            finished.acquire()

    def close(self) -> None:
        """Let the threads end (the executor is gone)."""
        for jobs in self.queues.values():
            jobs.put(None)


def _serve(jobs: queue.SimpleQueue) -> None:
    while (item := jobs.get()) is not None:
        job, finished = item
        try:
            job()
        finally:
            finished.release()
        del item, job  # hold no reference to the executor between steps
