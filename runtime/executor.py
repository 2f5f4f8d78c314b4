"""Run the devices' instruction programs for one iteration: five stream threads per device.

Each stream (compute, swap_in, swap_out, p2p_in, p2p_out) is a thread that runs its
instructions in program order (Harmony §4.4). An instruction first waits for the events it
names (`Instruction.waits`: earlier instructions of other streams of its device), then runs;
receives and all-reduces also wait for their partners. PyTorch releases the GIL inside ops,
so one device's copies and sends overlap its compute and devices compute concurrently.
The executor adds no barrier the programs do not state; `Sync` turns a deadlock, a failed
thread or a silent peer into an error instead of a hang.

Varuna's opportunistic policy (Varuna §3.2: "the schedule for stage k may indicate that the
backward pass for micro-batch m must be scheduled, but the gradients for m may not have
arrived yet from stage k+1; in those cases, Varuna deviates from the schedule and
opportunistically schedules another ready task"). In programs that recompute (Varuna's
schedule; `opportunistic` turns it on or off), when the compute stream's next instruction is
a recompute R(m), or a backward B(m) no recompute precedes, and m's gradient has neither been
received nor waits in the transport, the first later forward F(k) runs first if it is ready:
its other events are done, its activations have arrived, and the device's pool has room for
one more stash of its stage (the last one's size). Varuna's runtime makes the same check at a
recompute (microsoft/varuna, pipeline.py: "run forward if gradients for backward are not
ready yet"). Between R(m) and B(m) nothing moves in (rule 2: a forward would hold a second set
of activations), a forward never moves past an update, all-reduce or swap, and forwards keep
their order; backwards keep theirs, so gradients accumulate in the same order and training is
bitwise that of the static order. The p2p_in thread receives in program order and sits in the
receive of m's gradient while F(k)'s activation waits in the mailbox, so the compute thread
takes F(k)'s receives over (claimed under the `Sync` lock, `owner`; the p2p_in thread skips
what the compute thread took) and, as Varuna's separate activation sender does, sends F(k)'s
outputs right after it (sends never block; the p2p_out thread skips them too), instead of
behind the gradient sends that precede them in program order. Under torch.distributed the
compute thread posts the activation's receive itself to learn whether it came: gloo matches
messages by tag, so that is safe from any thread; with NCCL (issue order) the policy is off.
`deviations` lists what ran early in the last step.
"""

from __future__ import annotations

import math
import queue
import threading
import time
import weakref
from collections.abc import Callable

import torch

from stagewise.ir.deviations import DeviationPoints
from stagewise.ir.errors import PlanError
from stagewise.ir.plan import STREAMS, Instruction, Program
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
        opportunistic: bool | None = None,
    ):
        """`programs` and `workers`: this process's (all of them in one process, one device's under
        torch.distributed); `device_of`: every stage's device, for all-reduce groups. `opportunistic`:
        Varuna's run-time deviation (module docstring) for programs that recompute (None, the default),
        for every program (True) or none (False); it may be changed between steps."""
        self.opportunistic = opportunistic
        self._plans: dict[int, DeviationPoints] = {}
        self.stash_bytes: dict[int, int] = {}  # stage -> bytes its last forward stashed
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
        self.owner: dict[int, dict[int, str]] = {p.device: {} for p in self.programs}  # adoptable index -> stream
        self.deviations: list[tuple[int, int, int]] = []  # (device, forward run early, the head it overtook)
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
        """Run this stream's instructions in order; on CUDA each waits for its events on the GPU too.

        Under Varuna's opportunistic policy (module docstring) the compute stream may run a later
        forward first, taking over its receives and sends: the p2p threads skip what it took."""
        device_streams = self.streams[program.device]
        plan = self._opportunities(program)
        try:
            with device_streams.running(stream):
                if plan is not None and stream == "compute":
                    self._compute_opportunistically(program, plan)
                    return
                for index, ins in enumerate(program.instructions):
                    if ins.stream != stream:
                        continue
                    if plan is not None and index in plan.adoptable and not self._claim(program.device, index, stream):
                        continue  # the compute stream took it over for a forward it ran early
                    self._run(program, index, stream)
        except Aborted:
            pass
        except BaseException as error:  # noqa: BLE001 - handed to the caller of run()
            self.sync.fail(error)
        finally:
            self.sync.thread_done()

    def _run(self, program: Program, index: int, stream: str) -> None:
        """Wait for instruction `index`'s events, execute it on `stream`'s thread, publish that it is done."""
        done, streams = self.done[program.device], self.streams[program.device]
        ins = program.instructions[index]
        label = f"dev{program.device} #{index} {ins}"
        if ins.waits:
            self.sync.wait_until(lambda: all(done[j] for j in ins.waits), label,
                                 [("done", program.device, j) for j in ins.waits])
            streams.wait(stream, ins.waits)
        start = time.perf_counter()
        self._execute(program.device, ins, label)
        end = time.perf_counter()
        streams.record(stream, index)
        self.timeline.append((program.device, ins.stream, index, start - self.started_at, end - self.started_at))
        with self.sync.locked():
            done[index] = True
            self.sync.changed(("done", program.device, index))

    # ---- Varuna's opportunistic policy (§3.2) ------------------------------------------------
    def _opportunities(self, program: Program) -> DeviationPoints | None:
        """The program's deviation points, if the policy applies to it this step (see `opportunistic`)."""
        if self.opportunistic is False or not getattr(self.transport, "adopts_receives", True):
            return None
        if program.device not in self._plans:
            self._plans[program.device] = DeviationPoints(program)
        plan = self._plans[program.device]
        return plan if plan.heads and (self.opportunistic or plan.recomputes) else None

    def _claim(self, device: int, index: int, stream: str) -> bool:
        """Take instruction `index` for `stream` unless another stream took it first; True if it is `stream`'s."""
        owner = self.owner[device]
        with self.sync.locked():
            return owner.setdefault(index, stream) == stream

    def _compute_opportunistically(self, program: Program, plan: DeviationPoints) -> None:
        """The compute stream in program order, except that when its next instruction is a backward
        (or the recompute before it) whose gradient has not arrived, a later forward that is ready
        runs first, with its receives and sends (Varuna §3.2)."""
        device, code = program.device, program.instructions
        done, owner = self.done[device], self.owner[device]
        pending = list(plan.compute)
        while pending:
            head = pending[0]
            for r in plan.act_recvs.get(head, ()):  # receives it took earlier to look at their messages
                if owner.get(r) == "compute" and not done[r]:
                    self._run(program, r, "compute")
            early = plan.candidate(pending)
            keys = [("done", device, j) for j in code[head].waits]
            if early is not None:
                keys += [("done", device, j) for j in code[early].waits + plan.act_recvs[early] + plan.grad_recvs[head]]
                keys += [("message", key) for r in plan.act_recvs[early] + plan.grad_recvs[head] for key in _keys(code[r])]
            choice = None

            def decide(head=head, early=early) -> bool:
                nonlocal choice
                if early is not None and not self._grad_arrived(program, plan, head) and self._ready_early(program, plan, early):
                    choice = early
                else:
                    choice = head if all(done[j] for j in code[head].waits) else None
                return choice is not None

            self.sync.wait_until(decide, f"dev{device} #{head} {code[head]}", keys)
            pending.remove(choice)
            if choice == head:
                self._run(program, head, "compute")
            else:
                self._run_early(program, plan, choice, head)
            if code[choice].phase == "F":
                self._note_stash(code[choice])

    def _grad_arrived(self, program: Program, plan: DeviationPoints, head: int) -> bool:
        """Whether the gradient `head`'s backward needs has been received or waits in the transport."""
        done, code = self.done[program.device], program.instructions
        return all(done[g] or all(self.transport.arrived(key) for key in _keys(code[g])) for g in plan.grad_recvs[head])

    def _ready_early(self, program: Program, plan: DeviationPoints, early: int) -> bool:
        """Whether forward `early` can run now (under the monitor's lock): its events are done but for
        its activations' receives, whose messages have arrived (the compute stream takes those receives
        over, posting them under torch.distributed to see), and its stash fits in the device's pool."""
        device, code = program.device, program.instructions
        done, owner = self.done[device], self.owner[device]
        recvs = plan.act_recvs[early]
        if not all(done[j] for j in code[early].waits if j not in recvs) or not self._headroom(code[early].stage):
            return False
        ready = True
        for r in recvs:
            if done[r]:
                continue
            if owner.setdefault(r, "compute") != "compute":
                return False  # the p2p_in thread is receiving it: it has not arrived
            ready = all([self.transport.poll(key, f"dev{device} #{r} {code[r]}") for key in _keys(code[r])]) and ready
        return ready

    def _headroom(self, stage: int) -> bool:
        """An early forward adds one stash: only where the pool has room for the stage's last one."""
        pool = self.workers[stage].pool
        if pool.capacity is None:
            return True
        need = self.stash_bytes.get(stage)
        return need is not None and pool.current + need <= pool.capacity

    def _note_stash(self, ins: Instruction) -> None:
        held = self.workers[ins.stage].pool.held.get(("stash", ins.stage, ins.microbatch))
        if held is not None:
            self.stash_bytes[ins.stage] = held[1]

    def _run_early(self, program: Program, plan: DeviationPoints, early: int, head: int) -> None:
        """Forward `early` ahead of `head`: its receives (messages already here), the forward, and its
        sends right away (they never block), which the p2p_out thread then skips."""
        done = self.done[program.device]
        for r in plan.act_recvs[early]:
            if not done[r]:
                self._run(program, r, "compute")
        self._run(program, early, "compute")
        self.deviations.append((program.device, early, head))
        for s in plan.act_sends[early]:
            if self._claim(program.device, s, "compute"):
                self._run(program, s, "compute")

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
        elif ins.kind == "swap_in":  # what: weights, grads, optimizer, or one microbatch's stash
            worker.swap_in(ins.what, label, ins.microbatch)
            self.streams[device].hand_to(worker.tensors(ins.what, ins.microbatch).values(), "compute")
        elif ins.kind in ("swap_out", "free"):
            self.streams[device].hand_to(worker.tensors(ins.what, ins.microbatch).values(), "swap_out")
            worker.swap_out(ins.what, ins.kind == "swap_out", label, ins.microbatch)
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


def _keys(ins: Instruction) -> list[tuple]:
    """The transport keys of a receive's messages: (what, value, microbatch, sender stage, receiver stage)."""
    return [(ins.what, value, ins.microbatch, ins.peer_stage, ins.stage) for value in ins.values]
