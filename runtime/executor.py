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
import time
import weakref

import torch

from stagewise.ir.deviations import DeviationPoints
from stagewise.ir.instructions import (
    AllReduceGradNorm,
    AllReduceShared,
    Backward,
    Carried,
    Forward,
    Free,
    GradNormPart,
    HostUpdate,
    Instruction,
    MessageKey,
    Recompute,
    Recv,
    Send,
    StashIn,
    StashOut,
    Stream,
    SwapIn,
    SwapOut,
    Update,
    message_keys,
)
from stagewise.ir.interpreter import Interpreter, stashes
from stagewise.ir.program import Program
from stagewise.runtime.streams import DeviceStreams
from stagewise.runtime.sync import Aborted, Sync
from stagewise.runtime.threads import StreamThreads
from stagewise.runtime.transport import LocalTransport
from stagewise.runtime.worker import StageWorker

DEFAULT_TIMEOUT_S = 300.0


class StreamExecutor(Interpreter):
    """Runs the programs on stream threads; one handler per instruction kind executes it."""

    handlers = {
        Forward: "_forward", Recompute: "_forward", Backward: "_backward", Update: "_update",
        HostUpdate: "_update", GradNormPart: "_count_norm_part", AllReduceShared: "_all_reduce_shared",
        AllReduceGradNorm: "_all_reduce_norm", Send: "_send", Recv: "_recv",
        SwapIn: "_swap_in", StashIn: "_swap_in", SwapOut: "_swap_out", Free: "_swap_out", StashOut: "_swap_out",
    }

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
        # each instruction's name in errors, formatted once rather than at every step
        self.labels = {p.device: [f"dev{p.device} #{i} {ins}" for i, ins in enumerate(p.instructions)]
                       for p in programs}

    def run(self, microbatches: int) -> torch.Tensor:
        """One iteration; inputs must already be provided to the workers. Returns the mean loss."""
        self.microbatches = microbatches
        streams = [(p, s) for p in self.programs for s in Stream if any(i.stream is s for i in p.instructions)]
        self.sync = Sync(len(streams), self.timeout_s)
        self.transport.sync = self.sync
        self.done = {p.device: [False] * len(p.instructions) for p in self.programs}
        self.owner: dict[int, dict[int, Stream]] = {p.device: {} for p in self.programs}  # adoptable index -> stream
        self.deviations: list[tuple[int, int, int]] = []  # (device, forward run early, the head it overtook)
        self.timeline: list[tuple[int, Stream, int, float, float]] = []  # measured (device, stream, index, start, end)
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

    def _stream(self, program: Program, stream: Stream) -> None:
        """Run this stream's instructions in order; on CUDA each waits for its events on the GPU too.

        Under Varuna's opportunistic policy (module docstring) the compute stream may run a later
        forward first, taking over its receives and sends: the p2p threads skip what it took."""
        device_streams = self.streams[program.device]
        plan = self._opportunities(program)
        try:
            with device_streams.running(stream):
                if plan is not None and stream is Stream.COMPUTE:
                    self._compute_opportunistically(program, plan)
                    return
                for index, ins in enumerate(program.instructions):
                    if ins.stream is not stream:
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

    def _run(self, program: Program, index: int, stream: Stream) -> None:
        """Wait for instruction `index`'s events, execute it on `stream`'s thread, publish that it is done."""
        done, streams = self.done[program.device], self.streams[program.device]
        ins = program.instructions[index]
        label = self.labels[program.device][index]
        if ins.waits:
            self.sync.wait_until(lambda: all(done[j] for j in ins.waits), label,
                                 [("done", program.device, j) for j in ins.waits])
            streams.wait(stream, ins.waits)
        start = time.perf_counter()
        self.dispatch(program.device, index, ins)
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

    def _claim(self, device: int, index: int, stream: Stream) -> bool:
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
                if owner.get(r) is Stream.COMPUTE and not done[r]:
                    self._run(program, r, Stream.COMPUTE)
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

            self.sync.wait_until(decide, self.labels[device][head], keys)
            pending.remove(choice)
            if choice == head:
                self._run(program, head, Stream.COMPUTE)
            else:
                self._run_early(program, plan, choice, head)
            if isinstance(code[choice], Forward):
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
            if owner.setdefault(r, Stream.COMPUTE) is not Stream.COMPUTE:
                return False  # the p2p_in thread is receiving it: it has not arrived
            ready = all([self.transport.poll(key, self.labels[device][r]) for key in _keys(code[r])]) and ready
        return ready

    def _headroom(self, stage: int) -> bool:
        """An early forward adds one stash: only where the pool has room for the stage's last one."""
        pool = self.workers[stage].pool
        if pool.capacity is None:
            return True
        need = self.stash_bytes.get(stage)
        return need is not None and pool.current + need <= pool.capacity

    def _note_stash(self, ins: Forward) -> None:
        held = self.workers[ins.stage].pool.held.get(("stash", ins.stage, ins.microbatch))
        if held is not None:
            self.stash_bytes[ins.stage] = held[1]

    def _run_early(self, program: Program, plan: DeviationPoints, early: int, head: int) -> None:
        """Forward `early` ahead of `head`: its receives (messages already here), the forward, and its
        sends right away (they never block), which the p2p_out thread then skips."""
        done = self.done[program.device]
        for r in plan.act_recvs[early]:
            if not done[r]:
                self._run(program, r, Stream.COMPUTE)
        self._run(program, early, Stream.COMPUTE)
        self.deviations.append((program.device, early, head))
        for s in plan.act_sends[early]:
            if self._claim(program.device, s, Stream.COMPUTE):
                self._run(program, s, Stream.COMPUTE)

    # ---- the handlers: one per instruction kind ----------------------------------------------
    def _forward(self, device: int, index: int, ins: Forward | Recompute) -> None:
        self.workers[ins.stage].forward(ins.microbatch, self.labels[device][index], stash=stashes(ins))

    def _backward(self, device: int, index: int, ins: Backward) -> None:
        self.workers[ins.stage].backward(ins.microbatch, 1.0 / self.microbatches, self.labels[device][index])

    def _update(self, device: int, index: int, ins: Update | HostUpdate) -> None:
        """The optimizer step on the device or (HostUpdate) on host masters; `clip` scales first."""
        self.workers[ins.stage].update(self.labels[device][index], on_host=isinstance(ins, HostUpdate), clip=ins.clip)

    def _send(self, device: int, index: int, ins: Send) -> None:
        worker, label = self.workers[ins.stage], self.labels[device][index]
        for key in message_keys(ins):
            if ins.carries is Carried.ACTIVATIONS:
                tensor = worker.output(ins.microbatch, key.value)
            else:
                tensor = worker.take_input_grad(ins.microbatch, key.value)
            self.streams[device].hand_to([tensor], Stream.P2P_OUT)
            self.transport.send(_transport_key(key), device, ins.peer, tensor, label)

    def _recv(self, device: int, index: int, ins: Recv) -> None:
        worker, label = self.workers[ins.stage], self.labels[device][index]
        for key in message_keys(ins):
            tensor = self.transport.recv(_transport_key(key), label)
            self.streams[device].hand_to([tensor], Stream.COMPUTE)
            buffer = ("buffer",) + _transport_key(key)
            if ins.carries is Carried.ACTIVATIONS:
                worker.provide(ins.microbatch, key.value, tensor, buffer)
            else:
                worker.add_output_grad(ins.microbatch, key.value, tensor, buffer)

    def _swap_in(self, device: int, index: int, ins: SwapIn | StashIn) -> None:
        """State (weights, grads, optimizer) or one microbatch's stash into the device pool."""
        worker = self.workers[ins.stage]
        what, microbatch = _moved(ins)
        worker.swap_in(what, self.labels[device][index], microbatch)
        self.streams[device].hand_to(worker.tensors(what, microbatch).values(), Stream.COMPUTE)

    def _swap_out(self, device: int, index: int, ins: SwapOut | Free | StashOut) -> None:
        """Write back (SwapOut, StashOut) or drop (Free) the device copy."""
        worker = self.workers[ins.stage]
        what, microbatch = _moved(ins)
        self.streams[device].hand_to(worker.tensors(what, microbatch).values(), Stream.SWAP_OUT)
        worker.swap_out(what, not isinstance(ins, Free), self.labels[device][index], microbatch)

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
        result = self.transport.all_reduce(tag, self._devices(ins.group), device, summed, self.labels[device][index])
        for w, n in zip(local, names, strict=True):
            w.set_grads(n, [r.clone() for r in result])

    def _all_reduce_norm(self, device: int, index: int, ins: AllReduceGradNorm) -> None:
        """The whole model's gradient norm; stages counted live scale right away, those whose part was
        counted ahead keep the coefficient for their update."""
        local = [self.workers[s] for s in ins.group if self.device_of[s] == device]
        square_sum = sum(w.grad_square_sum() if w.norm_part is None else w.norm_part for w in local)
        tag = (self.iteration, type(ins).__name__, (), ins.group)
        (total,) = self.transport.all_reduce(tag, self._devices(ins.group), device, [square_sum],
                                             self.labels[device][index])
        coefficient = min(self.clip_grad_norm / (math.sqrt(float(total)) + 1e-6), 1.0)
        for w in local:
            if w.norm_part is None:
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


def _transport_key(key: MessageKey) -> tuple:
    """The transport's key of a message (hashable, and a gloo tag's source under torch.distributed)."""
    return (key.carries.value, key.value, key.microbatch, key.src_stage, key.dst_stage)


def _keys(ins: Instruction) -> list[tuple]:
    """The transport keys of a receive's messages."""
    assert isinstance(ins, Recv), ins
    return [_transport_key(key) for key in message_keys(ins)]
