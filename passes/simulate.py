"""Event-driven simulation of the device programs the runtime executes, on five streams per device.

Harmony §4.4 runs every device on five streams (compute, swap-in, swap-out, p2p-in, p2p-out)
ordered by events; this pass plays the same `Program`s forward in time instead of running
them, so the planner can score a plan before training and the difference between prediction
and measurement stays measurable (DESIGN.md: "the simulator and the runtime read the same
instruction programs").

Rules, one per instruction kind:

- Instructions on one stream run in program order; an instruction starts once its stream is
  free and the instructions it depends on have finished.
- `compute` F of a microbatch waits for that microbatch's activation receives; B waits for its
  F and its gradient receives; U waits for everything before it in the program.
- `send` waits for the compute that produced its values and occupies p2p_out until the data
  has arrived (a blocking send, as an NCCL kernel on a stream). The data starts moving at
  once: the runtime's mailbox buffers it, so the receiver need not have posted its `recv`.
- `recv` finishes when the matching send (same what, values, microbatch, src -> dst) has
  arrived: bytes / link bandwidth + latency.
- Transfers in flight on one link share its bandwidth fairly, and every finish time is
  recomputed whenever a transfer starts or ends (Srifty §4.3's fair-share simulator).
- `allreduce` starts when every member of its group has reached it and costs a ring
  all-reduce, 2 (n - 1) / n * bytes over the slowest link of the ring.
- Every instruction also costs the runtime's own `instruction_s` (dispatch and the wake-up of
  the stream thread that runs it): added to computes and swaps, and to a transfer's latency.
- A CPU device's compute that starts after its compute stream sat idle (waiting for an input)
  costs `wake_s` more: the core has clocked down and its caches went cold, while the profiler
  times layers back to back (measured at compile, passes/contention.py).
- Devices that share a host (CPU devices of one process: threads on its cores, under one GIL)
  slow each other down the way concurrent transfers share a link: with k of them computing at
  once each computes at `concurrency[k - 1]` of its speed alone (measured), recomputed
  whenever a compute starts or ends.
- Varuna's opportunistic policy (§3.2), as the runtime applies it to programs that recompute:
  when a device's next compute is a recompute R(m), or a backward B(m) no recompute precedes,
  whose gradient has not arrived, and the first later forward F(k) is ready (its activations
  arrived, its other dependencies done; no update, all-reduce or swap between the two), F(k)
  starts first; its receives complete at once and its sends start as it ends, outside
  p2p_out's order. The simulator has no memory capacity, so the runtime's headroom check (one
  more stash must fit in the pool) has no counterpart here. `simulate(..., opportunistic=False)`
  predicts the static order.

Memory per device is the static state of its stages plus the activations each stage stashes
from the start of a forward to the end of its backward (less while a stash is swapped out), and
the transfer buffers its receives fill, held until that stage's backward of the microbatch; the peak over the timeline is what
GPipe (m stashed microbatches) and 1F1B (at most p) differ in (Narayanan §4.2.2).
"""

from __future__ import annotations

import heapq
import json
import math
import struct
import zlib
from collections import defaultdict, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from stagewise.ir.deviations import DeviationPoints
from stagewise.ir.errors import PlanError
from stagewise.ir.plan import STREAMS, Instruction, Program, Transfer

_EPS = 1e-12
WAKE_IDLE_S = 1e-3  # a compute stream idle this long pays SimCost.wake_s at its next compute


# ---- inputs ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class SimCost:
    """Seconds and bytes the simulator charges; profiled or analytic numbers, per stage and value.

    Per stage s: `forward_s[s]` / `backward_s[s]` seconds for one microbatch, `update_s[s]`
    seconds for the optimizer step, `stash_bytes[s]` held from a microbatch's F to its B, and
    `state_bytes[s]` (parameters, gradients, optimizer state) held all the time. Missing
    entries cost nothing. `value_bytes` gives each transferred value's bytes per microbatch
    (its gradient has the same size); `tensor_bytes` each all-reduced shared gradient.
    A link from device a to b has `links[(a, b)]` bytes/s, else `bandwidth`; with
    `duplex=False` both directions share one link. `instruction_s`, `concurrency` and
    `shared_devices`: the runtime's per-instruction cost and host contention (module docstring).
    """

    forward_s: tuple[float, ...]
    backward_s: tuple[float, ...]
    update_s: tuple[float, ...] = ()
    stash_bytes: tuple[float, ...] = ()
    state_bytes: tuple[float, ...] = ()
    value_bytes: dict[str, float] = field(default_factory=dict)
    tensor_bytes: dict[str, float] = field(default_factory=dict)
    bandwidth: float = math.inf
    links: dict[tuple[int, int], float] = field(default_factory=dict)
    latency_s: float = 0.0
    duplex: bool = True
    host_bandwidth: float = math.inf  # bytes/s between a device and host memory (swaps)
    instruction_s: float = 0.0  # the runtime's own seconds per instruction
    concurrency: tuple[float, ...] = ()  # speed of each of k computes of `shared_devices` at once
    shared_devices: frozenset[int] = frozenset()  # devices whose compute shares the host
    wake_s: float = 0.0  # added to a shared device's compute after its compute stream sat idle
    update_concurrency: tuple[float, ...] = ()  # as `concurrency`, for updates (U); else `concurrency`

    @classmethod
    def uniform(cls, n_stages: int, forward_s: float, backward_s: float, **kwargs) -> SimCost:
        """Equal stages: the setting in which the bubble formulas of §4.2.2 hold exactly."""
        return cls((forward_s,) * n_stages, (backward_s,) * n_stages, **kwargs)

    def compute_s(self, ins: Instruction) -> float:
        table = {"F": self.forward_s, "R": self.forward_s, "B": self.backward_s, "U": self.update_s}[ins.phase]
        return _at(table, ins.stage)

    def speed_with(self, computing: int, update: bool = False) -> float:
        """Each shared-host compute's speed (an update's, with `update`) while `computing` of them run
        (beyond the measured counts, the last measured throughput split further)."""
        curve = self.update_concurrency if update and self.update_concurrency else self.concurrency
        known = len(curve)
        if computing <= 1 or not known:
            return 1.0
        if computing <= known:
            return curve[computing - 1]
        return curve[-1] * known / computing

    def link(self, src: int, dst: int) -> tuple[int, int]:
        """The key of the link a transfer from src to dst occupies."""
        return (src, dst) if self.duplex else (min(src, dst), max(src, dst))

    def link_bandwidth(self, src: int, dst: int) -> float:
        if (src, dst) in self.links or self.duplex:
            return self.links.get((src, dst), self.bandwidth)
        return self.links.get((dst, src), self.bandwidth)

    def __post_init__(self) -> None:
        if self.bandwidth <= 0 or any(b <= 0 for b in self.links.values()):
            raise PlanError("link bandwidths must be positive bytes/s (math.inf for free transfers)")

    def bytes_of(self, ins: Instruction) -> float:
        if ins.kind == "allreduce":
            return 8.0 if ins.what == "grad-norm" else sum(self.tensor_bytes.get(v, 0.0) for v in ins.values)
        return sum(self.value_bytes.get(v, 0.0) for v in ins.values)

    def allreduce_s(self, ins: Instruction) -> float:
        """Ring all-reduce: every member sends and receives 2 (n - 1) / n of the bytes."""
        n = len(ins.group)
        if n < 2:
            return 0.0
        ring = [
            self.link_bandwidth(a, b) for a, b in zip(ins.group, ins.group[1:] + ins.group[:1], strict=True)
        ]
        return 2 * (n - 1) / n * self.bytes_of(ins) / min(ring) + 2 * (n - 1) * self.latency_s


def transfer_bytes(transfers: Iterable[Transfer], microbatch_size: int) -> dict[str, float]:
    """`SimCost.value_bytes` from the plan's transfers: bytes per sample times the microbatch size."""
    return {t.value: t.bytes_per_sample * microbatch_size for t in transfers}


def _at(table: tuple[float, ...], stage: int | None) -> float:
    return table[stage] if stage is not None and stage < len(table) else 0.0


# ---- outputs -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Span:
    """One executed instruction: where it ran and when."""

    device: int
    stream: str
    index: int
    instruction: Instruction
    start: float
    end: float


@dataclass(frozen=True)
class SimResult:
    """The predicted iteration: its time, per-device busy/idle time, memory, bytes and timeline.

    `busy[d]` is the time device d's compute stream spends in compute instructions (F, B, U);
    `idle[d]` the rest of the iteration. `memory[d]` is the occupancy as (time, bytes) steps.
    """

    iteration_time: float
    busy: dict[int, float]
    idle: dict[int, float]
    peak_bytes: dict[int, float]
    p2p_bytes: dict[int, float]
    swap_in_bytes: dict[int, float]
    swap_out_bytes: dict[int, float]
    timeline: tuple[Span, ...]
    memory: dict[int, tuple[tuple[float, float], ...]]

    @property
    def bubble_fraction(self) -> float:
        """Bubble time over ideal time, t_pb / t_id (§4.2.2), with t_id the busiest device's compute."""
        ideal = max(self.busy.values())
        return (self.iteration_time - ideal) / ideal if ideal > 0 else 0.0

    def idle_fraction(self, device: int) -> float:
        """Device `device`'s idle time over its busy time: (p - 1)/m for GPipe and 1F1B on equal stages."""
        return self.idle[device] / self.busy[device] if self.busy[device] > 0 else math.inf

    def to_chrome_trace(self, path: str | Path) -> None:
        """Chrome trace JSON (loads in Perfetto / chrome://tracing): pid = device, tid = stream."""
        Path(path).write_text(json.dumps(chrome_trace(self)))

    def to_png(self, path: str | Path, width: int = 1200, row_height: int = 12) -> None:
        """A Gantt chart, one row per device stream, drawn without a plotting library."""
        write_png(path, gantt(self, width, row_height))


# ---- the simulation ----------------------------------------------------------------------------
def simulate(programs: Iterable[Program], cost: SimCost, opportunistic: bool | None = None) -> SimResult:
    """Play `programs` (one per device) forward in time under `cost`.

    `opportunistic`: Varuna's run-time deviation (module docstring), as the runtime applies it:
    for programs that recompute (None), every program (True) or none (False: the static order).
    """
    return _Simulation(tuple(programs), cost, opportunistic).run()


@dataclass
class _Flow:
    """A transfer in flight: the bytes still to move on its link."""

    key: tuple | str  # the message a transfer carries; a compute's phase (F, R, B, U)
    link: tuple[int, int]
    bandwidth: float
    remaining: float
    start: float
    send: tuple[int, int]  # the instruction that ends when the flow has drained


_HOST = ("host",)  # the link key of computes sharing one host


class _Simulation:
    def __init__(self, programs: tuple[Program, ...], cost: SimCost, opportunistic: bool | None = None):
        devices = [p.device for p in programs]
        if len(set(devices)) != len(devices):
            raise PlanError(f"simulate expects one program per device, got devices {devices}")
        self.programs = {p.device: p for p in programs}
        self.cost = cost
        self.queues = {
            (d, s): deque(i for i, ins in enumerate(p.instructions) if ins.stream == s)
            for d, p in self.programs.items()
            for s in STREAMS
        }
        self.deps = {d: _dependencies(p) for d, p in self.programs.items()}
        self.stage_device = {ins.stage: d for d, p in self.programs.items() for ins in p.instructions
                             if ins.stage is not None and ins.kind != "allreduce"}
        self.started: dict[tuple[int, int], float] = {}
        self.finished: dict[tuple[int, int], float] = {}
        self.timers: list[tuple[float, int, Callable[[], None]]] = []
        self.flows: list[_Flow] = []
        self.arrived: dict[tuple, deque[float]] = defaultdict(deque)  # key -> start times of arrived flows
        self.waiting: dict[tuple, deque[tuple[int, int]]] = defaultdict(deque)  # key -> posted recvs
        self.rendezvous: dict[tuple, list[tuple[int, int]]] = defaultdict(list)
        self.seen: dict[tuple, int] = defaultdict(int)
        self.span_start: dict[tuple[int, int], float] = {}
        self.memory: dict[int, list[tuple[float, float]]] = defaultdict(list)
        self.p2p: dict[int, float] = defaultdict(float)
        self.swapped_in: dict[int, float] = defaultdict(float)
        self.swapped_out: dict[int, float] = defaultdict(float)
        self.computed_until: dict[int, float] = {}  # device -> when its compute stream last finished
        self.buffers: dict[tuple, float] = defaultdict(float)  # (device, stage, microbatch) -> received bytes held
        self.resident_swap: dict[tuple, float] = {}  # (stage, what) -> bytes brought in by its last swap-in
        self.now = 0.0
        self._seq = 0
        plans = {} if opportunistic is False else {d: DeviationPoints(p) for d, p in self.programs.items()}
        self.deviations = {d: plan for d, plan in plans.items() if plan.heads and (opportunistic or plan.recomputes)}
        self.adopted: list[tuple[int, int]] = []  # sends a forward run early issues itself, off p2p_out's queue

    def run(self) -> SimResult:
        total = sum(len(p.instructions) for p in self.programs.values())
        while True:
            self._start_ready()
            if len(self.finished) == total:
                return self._result()
            t = self._next_time()
            if t is None:
                raise PlanError(f"the device programs wait on each other forever (deadlock): {self._stuck()}")
            self._advance(t)

    # -- starting instructions
    def _start_ready(self) -> None:
        """Start every stream head whose dependencies are met, until nothing more can start now; a
        compute head that Varuna's policy overtakes lets a later forward start first."""
        progressed = True
        while progressed:
            progressed = False
            for (device, stream), queue in self.queues.items():
                if stream == "compute" and device in self.deviations and self._start_early(device, queue):
                    progressed = True
                if queue and (device, queue[0]) not in self.started and self._ready(device, queue[0]):
                    self._start(device, queue[0])
                    progressed = True
            for op in [op for op in self.adopted if self._ready(*op)]:
                self.adopted.remove(op)
                self._start(*op)
                progressed = True

    def _ready(self, device: int, index: int) -> bool:
        return all((device, j) in self.finished for j in self.deps[device][index])

    # -- Varuna's opportunistic policy (§3.2), as runtime/executor.py applies it
    def _start_early(self, device: int, queue: deque[int]) -> bool:
        """If the compute head is a recompute, or a backward no recompute precedes, whose gradient has
        not arrived, and the first later forward is ready, start that forward now: it goes to the head
        of the compute queue, its activations' receives (arrived, not yet posted) complete at once,
        and its sends leave p2p_out's queue to start when it finishes, as the runtime's compute
        thread takes them over."""
        if not queue or (device, queue[0]) in self.started:
            return False
        plan, code = self.deviations[device], self.programs[device].instructions
        head = queue[0]
        early = plan.candidate(list(queue))
        if early is None or self._grad_arrived(device, plan, head) or not self._ready_early(device, plan, early):
            return False
        queue.remove(early)
        queue.appendleft(early)
        for r in plan.act_recvs[early]:
            if (device, r) not in self.started:
                self.queues[(device, "p2p_in")].remove(r)
                self._start(device, r)
        out = self.queues[(device, "p2p_out")]
        for s in plan.act_sends[early]:
            if out[0] != s:  # p2p_out has not reached it (the runtime's thread would own it)
                out.remove(s)
                self.adopted.append((device, s))
        assert self._ready(device, early), code[early]
        self._start(device, early)
        return True

    def _grad_arrived(self, device: int, plan: DeviationPoints, head: int) -> bool:
        code = self.programs[device].instructions
        return all((device, g) in self.finished or self.arrived[_message_key(code[g], code[g].peer, device)]
                   for g in plan.grad_recvs[head])

    def _ready_early(self, device: int, plan: DeviationPoints, early: int) -> bool:
        """Its other dependencies are done and each activation receive is done or, not yet posted, has
        its message (a posted receive completes the moment its message arrives)."""
        code, recvs = self.programs[device].instructions, plan.act_recvs[early]
        if not all((device, j) in self.finished for j in self.deps[device][early] if j not in recvs):
            return False
        return all((device, r) in self.finished
                   or ((device, r) not in self.started and self.arrived[_message_key(code[r], code[r].peer, device)])
                   for r in recvs)

    def _start(self, device: int, index: int) -> None:
        ins = self.programs[device].instructions[index]
        op = (device, index)
        self.started[op] = self.span_start[op] = self.now
        if ins.kind == "compute":
            self._start_compute(op, ins)
        elif ins.kind == "send":
            self._start_send(op, ins)
        elif ins.kind == "recv":
            self._post_recv(op, ins)
        elif ins.kind == "allreduce":
            self._join_allreduce(op, ins)
        elif ins.kind in ("swap_in", "swap_out", "free"):
            self._start_swap(op, ins)
        else:
            raise PlanError(f"the simulator does not model {ins.kind!r} instructions yet: {ins}")

    def _start_swap(self, op: tuple[int, int], ins: Instruction) -> None:
        """A swap moves its planned bytes over the host link; device memory follows it."""
        device = op[0]
        # a stage whose state stays on the device (counted static) only refreshes it in place
        # (updated weights back from a host optimizer): link time, no memory
        resident = _at(self.cost.state_bytes, ins.stage) > 0
        if ins.what == "stash":  # one microbatch's stash (sX): back in now, out once copied (_finish)
            if ins.kind == "swap_in":
                self.swapped_in[device] += ins.nbytes
                self.memory[device].append((self.now, _at(self.cost.stash_bytes, ins.stage)))
            else:
                self.swapped_out[device] += ins.nbytes
        elif ins.kind == "swap_in":
            self.swapped_in[device] += ins.nbytes
            if not resident:
                self.memory[device].append((self.now, ins.nbytes))
                self.resident_swap[(ins.stage, ins.what)] = ins.nbytes
        else:
            self.swapped_out[device] += ins.nbytes
            self.memory[device].append((self.now, -self.resident_swap.pop((ins.stage, ins.what), 0)))
        moving = ins.nbytes / self.cost.host_bandwidth if ins.nbytes else 0.0
        self._after(moving + self.cost.instruction_s, op)

    def _start_compute(self, op: tuple[int, int], ins: Instruction) -> None:
        stashes = (ins.phase == "F" and ins.what != "no-stash") or ins.phase == "R"
        if stashes:
            self.memory[op[0]].append((self.now, _at(self.cost.stash_bytes, ins.stage)))
        seconds = self.cost.compute_s(ins) + self.cost.instruction_s
        shared = op[0] in self.cost.shared_devices
        if shared and ins.stream == "compute" and self.now - self.computed_until.get(op[0], -math.inf) >= WAKE_IDLE_S:
            seconds += self.cost.wake_s
        if shared and self.cost.concurrency:
            self.flows.append(_Flow(ins.phase, _HOST, 1.0, seconds, self.now, op))
        else:
            self._after(seconds, op)

    def _start_send(self, op: tuple[int, int], ins: Instruction) -> None:
        src, dst = op[0], ins.peer
        nbytes = self.cost.bytes_of(ins)
        self.p2p[src] += nbytes
        key = _message_key(ins, sender=src, receiver=dst)
        bandwidth = self.cost.link_bandwidth(src, dst)
        self.flows.append(_Flow(key, self.cost.link(src, dst), bandwidth, nbytes, self.now, op))

    def _post_recv(self, op: tuple[int, int], ins: Instruction) -> None:
        key = _message_key(ins, sender=ins.peer, receiver=op[0])
        if self.arrived[key]:
            self._complete_recv(op, self.arrived[key].popleft())
        else:
            self.waiting[key].append(op)

    def _join_allreduce(self, op: tuple[int, int], ins: Instruction) -> None:
        tag = (ins.what, ins.values, ins.group)
        key = (*tag, self.seen[(op[0], tag)])
        self.seen[(op[0], tag)] += 1
        members = self.rendezvous[key]
        members.append(op)
        # groups list stages; each device joins once for all its member stages
        expected = len({self.stage_device.get(s, s) for s in ins.group})
        if len(members) == expected:
            duration = self.cost.allreduce_s(ins)
            for member in members:
                self.span_start[member] = self.now
                self._after(duration, member)
            del self.rendezvous[key]

    def _after(self, duration: float, op: tuple[int, int]) -> None:
        self._later(duration, lambda: self._finish(op))

    def _later(self, delay: float, action: Callable[[], None]) -> None:
        """Run `action` `delay` seconds from now (at once when the delay is zero)."""
        if delay <= 0:
            action()
            return
        self._seq += 1
        heapq.heappush(self.timers, (self.now + delay, self._seq, action))

    # -- finishing instructions
    def _finish(self, op: tuple[int, int]) -> None:
        device, index = op
        ins = self.programs[device].instructions[index]
        self.finished[op] = self.now
        self._dequeue(device, ins.stream, index)
        if ins.kind == "compute" and ins.stream == "compute":
            self.computed_until[device] = self.now
        if (ins.kind == "compute" and ins.phase == "B") or (ins.kind == "swap_out" and ins.what == "stash"):
            self.memory[device].append((self.now, -_at(self.cost.stash_bytes, ins.stage)))
        if ins.kind == "compute" and ins.phase == "B":
            self.memory[device].append((self.now, -self.buffers.pop((device, ins.stage, ins.microbatch), 0.0)))

    def _dequeue(self, device: int, stream: str, index: int) -> None:
        """A finished instruction leaves its stream's queue: the head, or one taken out of the queue
        when it started out of order (Varuna's early forward, its receives and sends)."""
        queue = self.queues[(device, stream)]
        if queue and queue[0] == index:
            queue.popleft()
        else:
            assert index not in queue, (device, stream, index)

    def _deliver(self, flow: _Flow) -> None:
        """The data of a send has arrived: the send finishes, and so does a recv waiting for it."""
        self._finish(flow.send)
        if self.waiting[flow.key]:
            self._complete_recv(self.waiting[flow.key].popleft(), flow.start)
        else:
            self.arrived[flow.key].append(flow.start)

    def _complete_recv(self, op: tuple[int, int], flow_start: float) -> None:
        """The recv's span covers the data moving, not the wait before the sender started. What it
        received occupies a transfer buffer until the stage's backward of that microbatch is done."""
        self.span_start[op] = min(max(self.started[op], flow_start), self.now)
        ins = self.programs[op[0]].instructions[op[1]]
        nbytes = self.cost.bytes_of(ins)
        if nbytes:
            self.memory[op[0]].append((self.now, nbytes))
            self.buffers[(op[0], ins.stage, ins.microbatch)] += nbytes
        self._finish(op)

    # -- time
    def _rates(self) -> list[float]:
        """Fair share: each flow gets its link's bandwidth divided by the flows on that link; a
        compute on a shared host gets its speed with as many computes running."""
        count: dict[tuple, int] = defaultdict(int)
        for flow in self.flows:
            count[flow.link] += 1
        computing = count[_HOST]
        return [self.cost.speed_with(computing, update=flow.key == "U") if flow.link == _HOST
                else flow.bandwidth / count[flow.link] for flow in self.flows]

    def _next_time(self) -> float | None:
        times = [self.timers[0][0]] if self.timers else []
        times += [
            self.now + f.remaining / r if f.remaining > 0 else self.now
            for f, r in zip(self.flows, self._rates(), strict=True)
        ]
        return min(times) if times else None

    def _advance(self, t: float) -> None:
        """Move to time t: drain flows at their current rates, then fire what ends at t."""
        dt, drained, moving = t - self.now, [], []
        for flow, rate in zip(self.flows, self._rates(), strict=True):
            ends = self.now + (flow.remaining / rate if flow.remaining > 0 else 0.0)
            if ends <= t + _EPS * max(1.0, abs(t)):
                drained.append(flow)
            else:
                flow.remaining -= rate * dt
                moving.append(flow)
        self.now, self.flows = t, moving
        for flow in drained:  # a drained flow's data is usable after the link latency
            if flow.link == _HOST:
                self._finish(flow.send)
            else:
                latency = self.cost.latency_s + self.cost.instruction_s
                self._later(latency, lambda flow=flow: self._deliver(flow))
        while self.timers and self.timers[0][0] <= t + _EPS * max(1.0, abs(t)):
            heapq.heappop(self.timers)[2]()

    def _stuck(self) -> str:
        heads = [
            f"dev{d} {s}: {self.programs[d].instructions[q[0]]}" for (d, s), q in self.queues.items() if q
        ]
        return "; ".join(heads)

    # -- the result
    def _result(self) -> SimResult:
        spans = sorted((self._span(op) for op in self.finished), key=_span_order)
        end = max((s.end for s in spans), default=0.0)
        devices = sorted(self.programs)
        busy = {
            d: sum(s.end - s.start for s in spans if s.device == d and s.instruction.kind == "compute")
            for d in devices
        }
        memory = {d: _occupancy(self.memory[d], self._static_bytes(d)) for d in devices}
        return SimResult(
            iteration_time=end,
            busy=busy,
            idle={d: end - busy[d] for d in devices},
            peak_bytes={d: max(b for _, b in memory[d]) for d in devices},
            p2p_bytes={d: self.p2p[d] for d in devices},
            swap_in_bytes={d: self.swapped_in[d] for d in devices},
            swap_out_bytes={d: self.swapped_out[d] for d in devices},
            timeline=tuple(spans),
            memory=memory,
        )

    def _span(self, op: tuple[int, int]) -> Span:
        ins = self.programs[op[0]].instructions[op[1]]
        return Span(op[0], ins.stream, op[1], ins, self.span_start[op], self.finished[op])

    def _static_bytes(self, device: int) -> float:
        stages = {ins.stage for ins in self.programs[device].instructions if ins.stage is not None}
        return sum(_at(self.cost.state_bytes, s) for s in stages)


def _span_order(span: Span) -> tuple:
    return (span.start, span.device, STREAMS.index(span.stream), span.index)


def _message_key(ins: Instruction, sender: int, receiver: int) -> tuple:
    """Messages match by stage (two stages of one device may talk); by device where no stage is named."""
    if ins.peer_stage is not None and ins.stage is not None:
        sender, receiver = (ins.stage, ins.peer_stage) if ins.kind == "send" else (ins.peer_stage, ins.stage)
    return (ins.what, ins.values, ins.microbatch, sender, receiver)


def _dependencies(program: Program) -> list[tuple[int, ...]]:
    """For each instruction, the events (earlier instructions on other streams) it waits for."""
    return [ins.waits for ins in program.instructions]


def _occupancy(deltas: list[tuple[float, float]], static: float) -> tuple[tuple[float, float], ...]:
    """(time, bytes) steps; at equal times a release comes before an allocation (B ends, then F starts)."""
    steps, level = [(0.0, static)], static
    for t, delta in sorted(deltas):
        level += delta
        steps.append((t, level))
    return tuple(steps)


# ---- exports -----------------------------------------------------------------------------------
def _label(ins: Instruction) -> str:
    if ins.kind == "compute":
        return ins.phase if ins.microbatch is None else f"{ins.phase}{ins.microbatch}"
    if ins.kind in ("send", "recv"):
        arrow = "->" if ins.kind == "send" else "<-"
        return f"{ins.kind} {ins.what} mb{ins.microbatch} {arrow} dev{ins.peer}"
    return f"{ins.kind} {ins.what or ''}".strip()


def chrome_trace(result: SimResult) -> dict:
    """Trace Event Format: one complete ("X") event per instruction, memory as counter ("C") events."""
    events: list[dict] = []
    for d in result.busy:
        events.append({"ph": "M", "name": "process_name", "pid": d, "args": {"name": f"dev{d}"}})
        events += [
            {"ph": "M", "name": "thread_name", "pid": d, "tid": t, "args": {"name": s}}
            for t, s in enumerate(STREAMS)
        ]
    for span in result.timeline:
        ins = span.instruction
        events.append(
            {
                "ph": "X",
                "name": _label(ins),
                "cat": ins.kind,
                "pid": span.device,
                "tid": STREAMS.index(span.stream),
                "ts": span.start * 1e6,
                "dur": (span.end - span.start) * 1e6,
                "args": {
                    "instruction": str(ins),
                    "index": span.index,
                    "stage": ins.stage,
                    "microbatch": ins.microbatch,
                },
            }
        )
    for d, steps in result.memory.items():
        events += [
            {"ph": "C", "name": "memory", "pid": d, "ts": t * 1e6, "args": {"bytes": b}} for t, b in steps
        ]
    return {"traceEvents": events, "displayTimeUnit": "ms"}


_COLOURS = {
    "F": (66, 133, 244),
    "B": (52, 168, 83),
    "U": (251, 140, 0),
    "send": (171, 71, 188),
    "recv": (233, 30, 99),
    "allreduce": (253, 216, 53),
    "swap_in": (0, 172, 193),
    "swap_out": (0, 137, 123),
}


def _colour(ins: Instruction) -> tuple[int, int, int]:
    rgb = _COLOURS.get(ins.phase if ins.kind == "compute" else ins.kind, (120, 120, 120))
    if (ins.microbatch or 0) % 2:  # alternate shades so neighbouring microbatches stay apart
        rgb = tuple(int(c * 0.75) for c in rgb)
    return rgb


def gantt(result: SimResult, width: int = 1200, row_height: int = 12) -> np.ndarray:
    """An RGB image: one row per (device, stream), x proportional to time, a bar per instruction."""
    devices = sorted(result.busy)
    rows = {(d, s): i for i, (d, s) in enumerate((d, s) for d in devices for s in STREAMS)}
    image = np.full((len(rows) * row_height, width, 3), 255, dtype=np.uint8)
    for (d, _), row in rows.items():
        if devices.index(d) % 2:
            image[row * row_height : (row + 1) * row_height] = 240
    scale = width / result.iteration_time if result.iteration_time > 0 else 0.0
    for span in result.timeline:
        x0, x1 = int(span.start * scale), min(width, math.ceil(span.end * scale))
        if x1 <= x0 or span.end <= span.start:
            continue
        top = rows[(span.device, span.stream)] * row_height + 1
        image[top : top + row_height - 2, x0 : max(x0 + 1, x1 - 1)] = _colour(span.instruction)
    for i in range(1, len(devices)):
        image[i * len(STREAMS) * row_height - 1] = 0
    return image


def write_png(path: str | Path, image: np.ndarray) -> None:
    """An 8-bit RGB PNG: filter byte 0 per scanline, zlib-compressed (PNG spec §11-12)."""
    height, width, _ = image.shape
    scanlines = np.concatenate([np.zeros((height, 1), np.uint8), image.reshape(height, width * 3)], axis=1)

    def chunk(tag: bytes, data: bytes) -> bytes:
        return (
            struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data) & 0xFFFFFFFF)
        )

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    data = (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(scanlines.tobytes(), 9))
        + chunk(b"IEND", b"")
    )
    Path(path).write_bytes(data)
