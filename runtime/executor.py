"""Run the devices' instruction programs for one iteration: a thread per stream of each device.

Each stream (compute, swap_in, swap_out, p2p_in, p2p_out) runs its instructions in program
order (Harmony §4.4) on a thread of its own. An instruction first waits for the events it
names (`Instruction.waits`: earlier instructions of other streams of its device), then runs;
receives and all-reduces also wait for their partners. PyTorch releases the GIL inside ops,
so one device's copies and sends overlap its compute and devices compute concurrently.
On a CPU device the swap streams have no thread, nor, where its messages stay in this process,
the two p2p streams: the thread that makes their next instruction ready runs it
(runtime/threadless.py), which saves the thread hand-offs a swap or message otherwise costs.
Where the in-process CPU devices could not compute in parallel anyway (one device, one core) one
thread walks every device's instructions in an order fixed at load (runtime/serial.py).
Each instruction runs through the call `Interpreter.bind` made for it when the programs were
loaded (runtime/tables.py): a step resolves no handler, worker or message key. The executor adds
no barrier the programs do not state; `Sync` turns a deadlock, a failed thread or a silent peer
into an error instead of a hang. A step is atomic and has a deadline (`timeout_s`): the caller
waits for the threads until then, and a step that fails is rolled back on every stage
(runtime/recovery.py, rollback.py).

Varuna's opportunistic policy (runtime/opportunistic.py) lets the compute stream of a program
that recomputes run a later forward early, taking over its receives and sends. The handlers, one
per instruction kind, are in runtime/handlers.py. The executor and these parts share one
`ExecutorState` (runtime/executor_state.py), each holding a reference to it:
`pipe._executor.state` is where the step count, the loss scaler, the last step's timeline and
the like are read.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable

import torch

from stagewise.ir.deviations import DeviationPoints
from stagewise.ir.errors import PlanError
from stagewise.ir.instructions import Stream
from stagewise.ir.precision import LossScaling
from stagewise.ir.program import Program
from stagewise.runtime.executor_state import ExecutorState, StepRun
from stagewise.runtime.forward_replay import ForwardReplay
from stagewise.runtime.handlers import InstructionHandlers
from stagewise.runtime.opportunistic import OpportunisticCompute
from stagewise.runtime.precision import LossScaler
from stagewise.runtime.recovery import GRACE_S, StepRecovery
from stagewise.runtime.rollback import StepGuard
from stagewise.runtime.serial import SerialWalk
from stagewise.runtime.step_timing import THREAD
from stagewise.runtime.streams import DeviceStreams
from stagewise.runtime.sync import Aborted, Sync
from stagewise.runtime.threadless import SWAPS, THREADLESS, ThreadlessStreams
from stagewise.runtime.threads import StreamThreads
from stagewise.runtime.transport import StepOutcome, Transport
from stagewise.runtime.worker import StageWorker

DEFAULT_TIMEOUT_S = 300.0


class StreamExecutor:
    """Runs the programs on stream threads; `interpreter` executes each instruction with its handler."""

    def __init__(
        self,
        programs: tuple[Program, ...],
        workers: list[StageWorker],
        transport: Transport,
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
        default), for every program (True) or none (False); `state.opportunistic` may change between steps. `seed`:
        the plan's, which random ops' streams are keyed by (runtime/forward_replay.py). `precision`: the
        autocast forwards run under; `loss_scaling`: fp16's, for a training executor (runtime/precision.py)."""
        by_stage = {w.stage.index: w for w in workers}
        torch_devices = {w.stage.device: w.device for w in workers}
        self.state = ExecutorState(  # what every part below reads and writes, declared in one place
            workers=by_stage, transport=transport, device_of=device_of,
            streams={p.device: DeviceStreams(torch_devices.get(p.device, torch.device("cpu"))) for p in programs},
            guard=StepGuard(by_stage, transport.pools), replay=ForwardReplay(seed), precision=precision,
            scaler=None if loss_scaling is None else LossScaler(loss_scaling), clip_grad_norm=clip_grad_norm,
            timeout_s=timeout_s, opportunistic=opportunistic)
        self.interpreter = InstructionHandlers(self.state)  # what each instruction kind does
        self.state.load(programs, self.interpreter.bind)  # each instruction a prebound call, once
        self.recovery = StepRecovery(self.state)  # a failed step's rollback; `broken`, `stuck`
        self.varuna = OpportunisticCompute(self.state)  # Varuna's compute stream
        self.threads = StreamThreads()  # one long-lived thread per (device, stream), reused by every step
        weakref.finalize(self, self.threads.close)

    @property
    def programs(self) -> tuple[Program, ...]:
        return self.state.programs

    @programs.setter
    def programs(self, programs: tuple[Program, ...]) -> None:
        """Programs may be replaced between steps; their lookups and calls are computed then, once."""
        self.state.load(programs, self.interpreter.bind)

    def settle(self, broken_ok: bool = False) -> None:
        """Before a step, a save or reading the state: a stuck step rolled back, or an error (runtime/recovery.py)."""
        self.recovery.settle(broken_ok)

    def run(self, microbatches: int, feed: Callable[[], None] | None = None) -> torch.Tensor:
        """One iteration, atomic: it completes on every stage, or it is rolled back and its error
        raised (runtime/recovery.py). `feed` gives the workers their inputs. Returns the mean loss."""
        state = self.state
        self.settle()
        state.guard.begin(state.updated)
        state.step_grad_norm, state.step_overflowed = None, False
        failed = self._attempt(microbatches, feed)
        partial = self._partial_loss() if failed is None else None
        if failed is not None:
            state.transport.notify_failure(failed)
        try:
            outcome: StepOutcome | None = state.transport.conclude(partial, failed)
        except BaseException as error:  # noqa: BLE001 - the ranks could not agree: broken
            failed, outcome = failed or error, None
        if outcome is not None and outcome.failure is None:
            assert outcome.loss is not None, "a step that succeeded has its last stages' losses"
            state.guard.commit()
            state.iteration += 1
            if state.step_grad_norm is not None:  # a forward-only pass keeps the last update's
                state.last_grad_norm, state.last_step_skipped = state.step_grad_norm, state.step_overflowed
                if state.scaler is not None:
                    state.scaler.conclude(state.step_overflowed)
            return outcome.loss / microbatches
        raise self.recovery.handle_failure(failed, outcome)

    def _attempt(self, microbatches: int, feed: Callable[[], None] | None) -> BaseException | None:
        """Feed the workers and run the step's threads until they return or the deadline passes; the
        error that failed the step, if one did."""
        state = self.state
        state.unfinished = state.jobs = None
        try:
            if feed is not None:
                feed()
            self._launch(microbatches)
            if state.step.sync.error is None:
                self._check_threadless_ran()
        except BaseException as error:  # noqa: BLE001 - the step failed: handed to run()
            if state.jobs is not None and not state.jobs.done():  # interrupted while waiting: stop the threads
                state.step.sync.fail(error)
                self._await_threads(GRACE_S)
            return error
        return state.step.sync.error

    def _launch(self, microbatches: int) -> None:
        """Start a thread job per stream; wait for them until the step's deadline."""
        state = self.state
        plans = {p.device: self.varuna.opportunities(p) for p in state.programs}
        serial = state.serial_step() if all(plan is None for plan in plans.values()) else None  # runtime/serial.py
        threadless = {p.device: ThreadlessStreams(p, state.tables[p.device], self._threadless(p, plans[p.device]))
                      for p in state.programs if serial is None}
        streams = [(p, s) for p in state.programs for s in state.tables[p.device].streams
                   if serial is None and s not in threadless[p.device].streams]
        sync = Sync(1 if serial is not None else len(streams), state.timeout_s)
        state.transport.sync = sync
        state.step = StepRun.launched(state.programs, microbatches, sync, threadless)
        deadline = time.monotonic() + state.timeout_s
        for device_streams in state.streams.values():
            device_streams.begin_step()
        if serial is not None:  # one thread walks every device's instructions (named for the first device)
            jobs = self.threads.start([((state.programs[0].device, Stream.COMPUTE), lambda: self._walk(serial))])
        else:
            jobs = self.threads.start([((p.device, s), self._stream_job(p, s, plans[p.device])) for p, s in streams])
        state.jobs = jobs
        if not jobs.wait(deadline - time.monotonic()):
            sync.fail(self.recovery.timeout_error())
            self._await_threads(GRACE_S)
        if state.unfinished is None:
            for device_streams in state.streams.values():
                device_streams.end_step()

    def _stream_job(self, program: Program, stream: Stream, plan: DeviationPoints | None) -> Callable[[], None]:
        """What a stream's thread runs this step."""
        return lambda: self._stream(program, stream, plan)

    def _await_threads(self, grace_s: float) -> None:
        """The step failed: give its threads `grace_s` to stop; those that do not are stuck."""
        jobs = self.state.jobs
        if jobs is not None and not jobs.wait(grace_s):
            self.state.unfinished = jobs

    def _partial_loss(self) -> torch.Tensor | None:
        """This process's sum of the microbatches' (weighted) losses (one last stage per data-parallel replica)."""
        losses = {}
        for worker in self.state.workers.values():
            if worker.is_last:
                losses.update(worker.losses)  # detached by the forward
                worker.losses.clear()
        return self.state.loss_weights.total(losses, self.state.step.microbatches)

    def _threadless(self, program: Program, plan: DeviationPoints | None) -> tuple[Stream, ...]:
        """The streams of `program` that run without a thread this step (runtime/threadless.py), on a CPU
        device unless Varuna's policy takes receives over: its swap streams (a swap is a host copy), and
        its p2p streams where its messages stay in this process."""
        state = self.state
        if plan is not None or state.streams[program.device].cuda:
            return ()
        candidates = THREADLESS if state.transport.in_memory else SWAPS
        return tuple(stream for stream in candidates if state.tables[program.device].order[stream])

    def _walk(self, serial: SerialWalk) -> None:
        """Run the step's instructions on this one thread, in the order fixed at load (runtime/serial.py)."""
        step = self.state.step

        def blame(error: BaseException, device: int, index: int) -> None:
            self.recovery.blame(error, device, index, self.state.program_of[device].instructions[index])
        try:
            serial.run(step.times, step.done, step.started, step.timeline, step.sync, blame)
        except Aborted:
            pass
        except BaseException as error:  # noqa: BLE001 - handed to the caller of run()
            step.sync.fail(error)
        finally:
            step.sync.thread_done()

    def _stream(self, program: Program, stream: Stream, plan: DeviationPoints | None) -> None:
        """Run this stream's instructions in order; on CUDA each waits for its events on the GPU too.

        Under Varuna's opportunistic policy the compute stream may run a later forward first,
        taking over its receives and sends: the p2p threads skip what it took."""
        device_streams = self.state.streams[program.device]
        sync, times = self.state.step.sync, self.state.step.times
        clock = times.thread_began(program.device, stream)  # runtime/step_timing.py
        try:
            with device_streams.running(stream):
                self._help(program.device)  # a threadless instruction that waits for nothing
                if plan is not None and stream is Stream.COMPUTE:
                    self.varuna.compute(program, plan, self._run)
                    return
                for index in self.state.tables[program.device].order[stream]:
                    if plan is not None and index in plan.adoptable and not self.varuna.claim(program.device, index, stream):
                        continue  # the compute stream took it over for a forward it ran early
                    self._run(program, index, stream)
        except Aborted:
            pass
        except BaseException as error:  # noqa: BLE001 - handed to the caller of run()
            sync.fail(error)
        finally:
            times.thread_ended(clock)
            sync.thread_done()

    def _run(self, program: Program, index: int, stream: Stream) -> None:
        """Wait for instruction `index`'s events, execute it on `stream`'s thread, then run what it
        made ready on threadless streams. Once the step failed nothing more runs (an instruction
        without waits would otherwise start, and hold the step, after the failure)."""
        step = self.state.step
        done, tables = step.done[program.device], self.state.tables[program.device]
        waits = program.instructions[index].waits
        if waits:
            # flags only turn True within a step (under the lock): events already done need no lock
            if not all([done[j] for j in waits]):
                step.sync.wait_until(lambda: all([done[j] for j in waits]), tables.labels[index], tables.waits_on[index])
            self.state.streams[program.device].wait(stream, waits)
        if step.sync.error is not None:
            raise Aborted
        self._execute(program, index, stream)
        self._help(program.device, tables.sends_to[index])

    def _execute(self, program: Program, index: int, stream: Stream) -> None:
        """Execute instruction `index` (its events are done) through its prebound call, record it,
        publish that it is done."""
        device, step, tables = program.device, self.state.step, self.state.tables[program.device]
        clock = THREAD.clock  # this thread's, for the step (runtime/step_timing.py)
        assert clock is not None, "instructions run on the step's stream threads"
        waited = clock.waited_s
        start = time.perf_counter()
        step.started[device][index] = True
        try:
            tables.calls[index]()
        except Aborted:
            raise
        except BaseException as error:
            self.recovery.blame(error, device, index, program.instructions[index])
            raise
        end = time.perf_counter()
        clock.ran(step.times, device, index, tables.stream[index], end - start - (clock.waited_s - waited))
        device_streams = self.state.streams[device]
        if device_streams.cuda:  # a CPU device has no events to record
            device_streams.record(stream, index)
        step.timeline.append((device, tables.stream[index], index, start - step.started_at, end - step.started_at))
        with step.sync.locked():
            step.done[device][index] = True
            if tables.stream[index] is not Stream.COMPUTE:  # no threadless stream is the compute stream
                step.threadless[device].finished(tables.stream[index])
            step.sync.changed(tables.done_key[index])

    # ---- threadless streams (runtime/threadless.py) --------------------------------------------
    def _help(self, device: int, delivered_to: int | None = None) -> None:
        """Run every threadless instruction that is ready now on `device` and, through the messages
        the sends among them deliver, on the receivers' devices (and on `delivered_to`, the receiver
        of the send that just finished, if one did)."""
        step, transport = self.state.step, self.state.transport
        if delivered_to is None and not step.threadless[device].streams:
            return  # asked after every instruction: a device with no threadless stream has nothing to run
        devices = [device] if delivered_to is None else [device, delivered_to]
        while devices:
            device = devices[-1]
            threadless = step.threadless.get(device)
            index = None
            if threadless is not None and threadless.streams:
                with step.sync.locked():
                    if step.sync.error is None:
                        index = threadless.claim(step.done[device], transport.arrived)
            if index is None:
                devices.pop()
                continue
            tables = self.state.tables[device]
            self._execute(self.state.program_of[device], index, tables.stream[index])
            receiver = tables.sends_to[index]
            if receiver is not None:
                devices.append(receiver)

    def _check_threadless_ran(self) -> None:
        """Every thread finished: a threadless instruction still unrun waited for something that never came."""
        for device, threadless in self.state.step.threadless.items():
            unrun = threadless.unrun()
            if unrun:
                raise PlanError("the device programs wait on each other forever (deadlock) at: "
                                f"{self.state.tables[device].labels[unrun[0]]}")
