"""What the executor's parts share: one explicit, typed state object instead of mixin attributes.

The executor (runtime/executor.py: which instruction runs when, on which thread), its
instruction handlers (runtime/handlers.py), Varuna's opportunistic policy
(runtime/opportunistic.py) and the failure path (runtime/recovery.py) each hold a reference to
one `ExecutorState` and read or write only what it declares here. `StepRun` is what one step
records as it runs; a fresh one replaces it at every step's launch, so nothing of a step leaks
into the next.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from stagewise.ir.deviations import DeviationPoints
from stagewise.ir.instructions import HostUpdate, Instruction, Stream, Update
from stagewise.ir.program import Program
from stagewise.runtime.forward_replay import ForwardReplay
from stagewise.runtime.loss_weights import LossWeights
from stagewise.runtime.precision import LossScaler
from stagewise.runtime.rollback import StepGuard
from stagewise.runtime.serial import SerialWalk, one_core, serial_order
from stagewise.runtime.step_timing import StepTimes
from stagewise.runtime.streams import DeviceStreams
from stagewise.runtime.sync import Sync
from stagewise.runtime.tables import ProgramTables
from stagewise.runtime.threadless import ThreadlessStreams
from stagewise.runtime.threads import Countdown
from stagewise.runtime.transport import Transport
from stagewise.runtime.worker import StageWorker


@dataclass
class StepRun:
    """One step's bookkeeping, read by every stream thread of the step (under `sync`'s lock where
    threads race) and, after it, by `pipe.stats` and the tests."""

    microbatches: int  # the step's microbatch count: each Backward's seed and the loss's mean
    sync: Sync  # the step's monitor: every blocking wait, and the first failure
    # per device: its threadless p2p streams this step (runtime/threadless.py)
    threadless: dict[int, ThreadlessStreams] = field(default_factory=dict)
    done: dict[int, list[bool]] = field(default_factory=dict)  # per device, per instruction: it finished
    started: dict[int, list[bool]] = field(default_factory=dict)  # per device, per instruction: it began
    # per device: an adoptable instruction's index -> the stream that claimed it (Varuna's policy)
    owner: dict[int, dict[int, Stream]] = field(default_factory=dict)
    # (device, forward run early, the head it overtook): what Varuna's policy changed this step
    deviations: list[tuple[int, int, int]] = field(default_factory=list)
    # measured (device, stream, index, start, end) of every instruction, in seconds from `started_at`
    timeline: list[tuple[int, Stream, int, float, float]] = field(default_factory=list)
    started_at: float = field(default_factory=time.perf_counter)  # the step's launch (perf_counter)
    times: StepTimes = field(default_factory=StepTimes)  # where each stream thread's time went (runtime/step_timing.py)

    @classmethod
    def launched(cls, programs: tuple[Program, ...], microbatches: int, sync: Sync,
                 threadless: dict[int, ThreadlessStreams]) -> StepRun:
        """A step about to start its threads: nothing done, nothing started, no claims."""
        times = StepTimes(programs)
        return cls(microbatches, sync, threadless, started_at=times.started_at, times=times,
                   done={p.device: [False] * len(p.instructions) for p in programs},
                   started={p.device: [False] * len(p.instructions) for p in programs},
                   owner={p.device: {} for p in programs})


@dataclass
class ExecutorState:
    """Everything the executor's parts read or write, each declared once with its type."""

    workers: dict[int, StageWorker]  # this process's stages by index: what the handlers run
    transport: Transport  # messages and all-reduces, in memory or over torch.distributed
    device_of: dict[int, int]  # every stage's device (other ranks' too): all-reduce groups
    streams: dict[int, DeviceStreams]  # per local device: CUDA streams and events (nothing on a CPU)
    guard: StepGuard  # what a step records to be undone (runtime/rollback.py)
    replay: ForwardReplay  # keyed random draws, so a recompute replays its forward
    precision: str  # the autocast forwards run under ("fp32", "bf16", "fp16")
    scaler: LossScaler | None  # fp16's dynamic loss scale (None in other precisions, and to evaluate)
    clip_grad_norm: float | None  # the global gradient norm's bound (None: no clipping)
    timeout_s: float  # a step's deadline; the pipeline may change it between steps
    opportunistic: bool | None  # Varuna's policy: where programs recompute (None), always, never
    # each microbatch's weight in the loss; the feed sets it, evaluate shares the training executor's
    loss_weights: LossWeights = field(default_factory=LossWeights)
    programs: tuple[Program, ...] = ()  # this process's device programs (`load` sets them)
    program_of: dict[int, Program] = field(default_factory=dict)  # the same, by device
    tables: dict[int, ProgramTables] = field(default_factory=dict)  # per device: its lookups, computed once
    updated: frozenset[int] = frozenset()  # the stages these programs update (none to evaluate)
    deviation_points: dict[int, DeviationPoints] = field(default_factory=dict)  # per device, computed once
    # every device on one thread (runtime/serial.py): where its devices could not compute in parallel anyway
    # (None: one in-process CPU device, or one core for all), wherever legal (True), never (False); may change
    one_thread: bool | None = None
    serial: SerialWalk | None = None  # the programs as one thread's walk, where legal (computed once)
    serial_pays: bool = False  # the devices could not compute in parallel: one of them, or one core
    stash_bytes: dict[int, int] = field(default_factory=dict)  # stage -> bytes its last forward stashed
    iteration: int = 0  # completed steps (a failed one does not count); keys random draws and tags
    step_grad_norm: float | None = None  # the running step's global gradient norm, once all-reduced
    step_overflowed: bool = False  # the running step's global grad norm is inf or NaN: no stage updates
    last_grad_norm: float | None = None  # the last completed training step's (None without clipping)
    last_step_skipped: bool = False  # the last training step updated no stage (inf or NaN gradients)
    jobs: Countdown | None = None  # the running step's stream threads, once launched
    unfinished: Countdown | None = None  # the last step's threads, when some had not returned at its end
    step: StepRun = field(init=False)  # the running (or last) step's bookkeeping

    def __post_init__(self) -> None:
        self.step = StepRun(0, Sync(0, self.timeout_s))  # before the first step: an empty record

    def load(self, programs: tuple[Program, ...], bind: Callable[[int, int, Instruction], Callable[[], object]]) -> None:
        """Programs may be replaced between steps; their lookups and prebound calls (`bind`: the
        interpreter's) are computed here, once."""
        self.programs = tuple(programs)
        self.program_of = {p.device: p for p in self.programs}
        self.tables = {p.device: ProgramTables(p) for p in self.programs}
        self.updated = frozenset(ins.stage for p in self.programs for ins in p.instructions
                                 if isinstance(ins, (Update, HostUpdate)))
        for program in self.programs:
            self.tables[program.device].lower(program, bind)
        self.deviation_points.clear()
        self.serial = self._serial_walk()
        self.serial_pays = len(self.programs) == 1 or one_core()

    def _serial_walk(self) -> SerialWalk | None:
        """The programs as one thread's walk (runtime/serial.py), for in-process CPU devices without a
        memory limit: on a bounded device a message may wait for room a later instruction frees
        (runtime/transport.py), and a walk fixed at load would wait for it on the one thread."""
        if not self.transport.in_memory or any(s.cuda for s in self.streams.values()):
            return None
        if any(pool.capacity is not None for pool in self.transport.pools):
            return None
        order = serial_order(self.programs, self.tables, self.device_of)
        return None if order is None else SerialWalk(order, self.tables)

    def serial_step(self) -> SerialWalk | None:
        """The walk this step runs on one thread, or None: a thread per stream (`one_thread`)."""
        wanted = self.serial_pays if self.one_thread is None else self.one_thread
        return self.serial if wanted else None
