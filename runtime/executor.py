"""Run the devices' instruction programs for one iteration: a thread per stream of each device.

Each stream (compute, swap_in, swap_out, p2p_in, p2p_out) runs its instructions in program
order (Harmony §4.4) on a thread of its own. An instruction first waits for the events it
names (`Instruction.waits`: earlier instructions of other streams of its device), then runs;
receives and all-reduces also wait for their partners. PyTorch releases the GIL inside ops,
so one device's copies and sends overlap its compute and devices compute concurrently.
On a CPU device whose messages stay in this process the two p2p streams have no thread: the
thread that makes their next instruction ready runs it (runtime/threadless.py), which saves
the thread hand-offs a message otherwise costs. The executor adds no barrier the programs do
not state; `Sync` turns a deadlock, a failed thread or a silent peer into an error instead of
a hang. A step is atomic and has a deadline (`timeout_s`): the caller waits for the threads until
then, and a step that fails is rolled back on every stage (runtime/recovery.py, rollback.py).

Varuna's opportunistic policy (runtime/opportunistic.py) lets the compute stream of a program
that recomputes run a later forward early, taking over its receives and sends. The handlers,
one per instruction kind, are in runtime/handlers.py.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable

import torch

from stagewise.ir.deviations import DeviationPoints
from stagewise.ir.errors import PlanError
from stagewise.ir.instructions import (
    AllReduceGradNorm,
    AllReduceShared,
    Backward,
    Forward,
    Free,
    GradNormPart,
    HostUpdate,
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
)
from stagewise.ir.interpreter import Interpreter
from stagewise.ir.precision import LossScaling
from stagewise.ir.program import Program
from stagewise.runtime.forward_replay import ForwardReplay
from stagewise.runtime.handlers import Handlers
from stagewise.runtime.loss_weights import LossWeights
from stagewise.runtime.opportunistic import OpportunisticCompute
from stagewise.runtime.precision import LossScaler
from stagewise.runtime.recovery import GRACE_S, StepRecovery
from stagewise.runtime.rollback import StepGuard
from stagewise.runtime.streams import DeviceStreams
from stagewise.runtime.sync import Aborted, Sync
from stagewise.runtime.tables import ProgramTables
from stagewise.runtime.threadless import THREADLESS, ThreadlessStreams
from stagewise.runtime.threads import Countdown, StreamThreads
from stagewise.runtime.transport import LocalTransport, StepOutcome
from stagewise.runtime.worker import StageWorker

DEFAULT_TIMEOUT_S = 300.0


class StreamExecutor(StepRecovery, OpportunisticCompute, Handlers, Interpreter):
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
        seed: int = 0,
        precision: str = "fp32",
        loss_scaling: LossScaling | None = None,
    ):
        """`programs` and `workers`: this process's (all of them in one process, one device's under
        torch.distributed); `device_of`: every stage's device, for all-reduce groups. `opportunistic`:
        Varuna's run-time deviation (runtime/opportunistic.py) for programs that recompute (None, the
        default), for every program (True) or none (False); it may be changed between steps. `seed`:
        the plan's, which random ops' streams are keyed by (runtime/forward_replay.py). `precision`: the
        autocast forwards run under; `loss_scaling`: fp16's, for a training executor (runtime/precision.py)."""
        self.precision = precision
        self.scaler = None if loss_scaling is None else LossScaler(loss_scaling)
        self.step_overflowed = False  # the running step's global grad norm is inf or NaN: no stage updates
        self.last_step_skipped = False
        self.replay = ForwardReplay(seed)
        self.opportunistic = opportunistic
        self._plans: dict[int, DeviationPoints] = {}
        self.stash_bytes: dict[int, int] = {}  # stage -> bytes its last forward stashed
        self.programs = programs  # sets `tables`
        self.workers = {w.stage.index: w for w in workers}
        self.device_of = device_of
        self.transport = transport
        self.clip_grad_norm = clip_grad_norm
        self.timeout_s = timeout_s
        self.iteration = 0  # completed steps (a failed one does not count)
        self.step_grad_norm: float | None = None  # the running step's global gradient norm, once all-reduced
        self.last_grad_norm: float | None = None  # the last completed step's (None without clipping)
        self.guard = StepGuard(self.workers, transport.pools)
        self.loss_weights = LossWeights()  # set by the feed when the loss's reduction is declared
        self.jobs: Countdown | None = None
        self.unfinished: Countdown | None = None
        self.threads = StreamThreads()
        weakref.finalize(self, self.threads.close)
        torch_devices = {w.stage.device: w.device for w in workers}
        self.streams = {p.device: DeviceStreams(torch_devices.get(p.device, torch.device("cpu"))) for p in programs}

    @property
    def programs(self) -> tuple[Program, ...]:
        return self._programs

    @programs.setter
    def programs(self, programs: tuple[Program, ...]) -> None:
        """Programs may be replaced between steps; their lookups are computed here, once."""
        self._programs = tuple(programs)
        self.program_of = {p.device: p for p in self._programs}
        self.tables = {p.device: ProgramTables(p) for p in self._programs}
        self._plans.clear()

    def run(self, microbatches: int, feed: Callable[[], None] | None = None) -> torch.Tensor:
        """One iteration, atomic: it completes on every stage, or it is rolled back and its error
        raised (runtime/recovery.py). `feed` gives the workers their inputs. Returns the mean loss."""
        self.settle()
        self.guard.begin()
        self.step_grad_norm, self.step_overflowed = None, False
        failed = self._attempt(microbatches, feed)
        partial = self._partial_loss() if failed is None else None
        if failed is not None:
            self.transport.notify_failure(failed)
        try:
            outcome: StepOutcome | None = self.transport.conclude(partial, failed)
        except BaseException as error:  # noqa: BLE001 - the ranks could not agree: broken
            failed, outcome = failed or error, None
        if outcome is not None and outcome.failure is None:
            self.guard.commit()
            self.iteration += 1
            if self.step_grad_norm is not None:  # a forward-only pass keeps the last update's
                self.last_grad_norm, self.last_step_skipped = self.step_grad_norm, self.step_overflowed
                if self.scaler is not None:
                    self.scaler.conclude(self.step_overflowed)
            return outcome.loss / microbatches
        raise self._failed(failed, outcome)

    def _attempt(self, microbatches: int, feed: Callable[[], None] | None) -> BaseException | None:
        """Feed the workers and run the step's threads until they return or the deadline passes; the
        error that failed the step, if one did."""
        self.unfinished = self.jobs = None
        try:
            if feed is not None:
                feed()
            self._launch(microbatches)
            if self.sync.error is None:
                self._check_threadless_ran()
        except BaseException as error:  # noqa: BLE001 - the step failed: handed to run()
            if self.jobs is not None and not self.jobs.done():  # interrupted while waiting: stop the threads
                self.sync.fail(error)
                self._await_threads(GRACE_S)
            return error
        return self.sync.error

    def _launch(self, microbatches: int) -> None:
        """Start a thread job per stream; wait for them until the step's deadline."""
        self.microbatches = microbatches
        plans = {p.device: self._opportunities(p) for p in self.programs}
        self.threadless = {p.device: ThreadlessStreams(p, self.tables[p.device], self._threadless(p, plans[p.device]))
                           for p in self.programs}
        streams = [(p, s) for p in self.programs for s in self.tables[p.device].streams
                   if s not in self.threadless[p.device].streams]
        self.sync = Sync(len(streams), self.timeout_s)
        self.transport.sync = self.sync
        self.done = {p.device: [False] * len(p.instructions) for p in self.programs}
        self.started = {p.device: [False] * len(p.instructions) for p in self.programs}
        self.owner: dict[int, dict[int, Stream]] = {p.device: {} for p in self.programs}  # adoptable index -> stream
        self.deviations: list[tuple[int, int, int]] = []  # (device, forward run early, the head it overtook)
        self.timeline: list[tuple[int, Stream, int, float, float]] = []  # measured (device, stream, index, start, end)
        self.started_at = time.perf_counter()
        deadline = time.monotonic() + self.timeout_s
        for device_streams in self.streams.values():
            device_streams.begin_step()
        self.jobs = self.threads.start(
            [((p.device, s), lambda p=p, s=s: self._stream(p, s, plans[p.device])) for p, s in streams])
        if not self.jobs.wait(deadline - time.monotonic()):
            self.sync.fail(self._timeout_error())
            self._await_threads(GRACE_S)
        if self.unfinished is None:
            for device_streams in self.streams.values():
                device_streams.end_step()

    def _await_threads(self, grace_s: float) -> None:
        """The step failed: give its threads `grace_s` to stop; those that do not are stuck."""
        if not self.jobs.wait(grace_s):
            self.unfinished = self.jobs

    def _partial_loss(self) -> torch.Tensor | None:
        """This process's sum of the microbatches' (weighted) losses (one last stage per data-parallel replica)."""
        losses = {}
        for worker in self.workers.values():
            if worker.is_last:
                losses.update({mb: loss.detach() for mb, loss in worker.losses.items()})
                worker.losses.clear()
        return self.loss_weights.total(losses, self.microbatches)

    def _threadless(self, program: Program, plan: DeviationPoints | None) -> tuple[Stream, ...]:
        """The p2p streams of `program` that run without a thread this step (runtime/threadless.py): on a
        CPU device whose messages stay in this process, unless Varuna's policy takes receives over."""
        if plan is not None or self.streams[program.device].cuda or not self.transport.in_memory:
            return ()
        return tuple(stream for stream in THREADLESS if self.tables[program.device].order[stream])

    def _stream(self, program: Program, stream: Stream, plan: DeviationPoints | None) -> None:
        """Run this stream's instructions in order; on CUDA each waits for its events on the GPU too.

        Under Varuna's opportunistic policy the compute stream may run a later forward first,
        taking over its receives and sends: the p2p threads skip what it took."""
        device_streams = self.streams[program.device]
        try:
            with device_streams.running(stream):
                self._help(program.device)  # a threadless instruction that waits for nothing
                if plan is not None and stream is Stream.COMPUTE:
                    self._compute_opportunistically(program, plan)
                    return
                for index in self.tables[program.device].order[stream]:
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
        """Wait for instruction `index`'s events, execute it on `stream`'s thread, then run what it
        made ready on threadless streams. Once the step failed nothing more runs (an instruction
        without waits would otherwise start, and hold the step, after the failure)."""
        done, tables = self.done[program.device], self.tables[program.device]
        ins = program.instructions[index]
        waits = ins.waits
        if waits:
            self.sync.wait_until(lambda: all([done[j] for j in waits]), tables.labels[index], tables.waits_on[index])
            self.streams[program.device].wait(stream, waits)
        if self.sync.error is not None:
            raise Aborted
        self._execute(program, index, stream)
        self._help(program.device, ins)

    def _execute(self, program: Program, index: int, stream: Stream) -> None:
        """Execute instruction `index` (its events are done), record it, publish that it is done."""
        device = program.device
        ins = program.instructions[index]
        start = time.perf_counter()
        self.started[device][index] = True
        try:
            self.dispatch(device, index, ins)
        except Aborted:
            raise
        except BaseException as error:
            self._blame(error, device, index, ins)
            raise
        end = time.perf_counter()
        self.streams[device].record(stream, index)
        self.timeline.append((device, ins.stream, index, start - self.started_at, end - self.started_at))
        with self.sync.locked():
            self.done[device][index] = True
            self.threadless[device].finished(ins.stream)
            self.sync.changed(self.tables[device].done_key[index])

    # ---- threadless streams (runtime/threadless.py) --------------------------------------------
    def _help(self, device: int, finished: Instruction | None = None) -> None:
        """Run every threadless instruction that is ready now on `device` and, through the messages
        the sends among them (and `finished`, if a send) deliver, on the receivers' devices."""
        devices = [device, finished.peer] if isinstance(finished, Send) else [device]
        while devices:
            device = devices[-1]
            threadless = self.threadless.get(device)
            index = None
            if threadless is not None and threadless.streams:
                with self.sync.locked():
                    if self.sync.error is None:
                        index = threadless.claim(self.done[device], self.transport.arrived)
            if index is None:
                devices.pop()
                continue
            program = self.program_of[device]
            ins = program.instructions[index]
            self._execute(program, index, ins.stream)
            if isinstance(ins, Send):
                devices.append(ins.peer)

    def _check_threadless_ran(self) -> None:
        """Every thread finished: a threadless instruction still unrun waited for something that never came."""
        for device, threadless in self.threadless.items():
            unrun = threadless.unrun()
            if unrun:
                raise PlanError("the device programs wait on each other forever (deadlock) at: "
                                f"{self.tables[device].labels[unrun[0]]}")
