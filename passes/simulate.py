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
  F and its gradient receives; U waits for everything before it in the program. A split backward
  (zero bubble) charges its input gradient `Bi` and its weight gradient `W` their parts of B's
  seconds (`SimCost.input_grad_share`), with what splitting adds on this machine
  (`SimCost.split_backward_s`); what B does to memory, W does (the stash lives until then),
  and from Bi to W the gradients Bi recorded for W are held too (`SimCost.recorded_bytes`).
- `send` waits for the compute that produced its values and occupies p2p_out until the data
  has arrived (a blocking send, as an NCCL kernel on a stream). The data starts moving at
  once: the runtime's mailbox buffers it, so the receiver need not have posted its `recv`.
- `recv` finishes when the matching send (same what, values, microbatch, src -> dst) has
  arrived: bytes / link bandwidth + latency.
- A swap or stash move crosses its device's host link (PCIe; a CPU device's memory copy), never
  the links between devices: bytes / host link, in fair share with the moves in the same direction
  of every device behind that host.
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
- Varuna's opportunistic policy (§3.2), as the runtime applies it: passes/sim_varuna.py.

Memory per device is the static state of its stages, their gradients from a stage's first
backward to its update (with `SimCost.grad_bytes`), the activations each stage stashes from the
start of a forward to the end of its backward (less while a stash is swapped out), and the
transfer buffers messages fill from their arrival (the runtime's mailbox holds them before the
receive is posted) until that stage's backward of the microbatch. The peak over the timeline is
what GPipe (m stashed microbatches) and 1F1B (at most p) differ in (Narayanan §4.2.2).
"""

from __future__ import annotations

import math
from collections import defaultdict, deque
from collections.abc import Callable, Iterable

from stagewise.ir.deviations import DeviationPoints
from stagewise.ir.errors import PlanError
from stagewise.ir.instruction_facts import Activity, Link
from stagewise.ir.instructions import (
    ALL_REDUCES,
    COMPUTES,
    AllReduceGradNorm,
    AllReduceShared,
    Backward,
    Forward,
    Free,
    GradNormPart,
    HostUpdate,
    InputGrad,
    Instruction,
    MessageKey,
    Recompute,
    Recv,
    Send,
    StashIn,
    StashOut,
    State,
    Stream,
    SwapIn,
    SwapOut,
    Update,
    WeightGrad,
    message_keys,
)
from stagewise.ir.interpreter import Interpreter, stashes
from stagewise.ir.program import Program
from stagewise.passes.sim_clock import HOST, FairShareClock, Flow, HostLink
from stagewise.passes.sim_cost import SimCost, _at, transfer_bytes
from stagewise.passes.sim_result import SimResult, Span, occupancy, span_order
from stagewise.passes.sim_varuna import VarunaDeviation

__all__ = ["SimCost", "SimResult", "Span", "simulate", "transfer_bytes"]

# what a whole backward does to memory, a split one does at its weight gradient (its input gradient keeps
# the graph): gradients come, the stash and the microbatch's received buffers go
_WHOLE_BACKWARD = (Backward, WeightGrad)
WAKE_IDLE_S = 1e-3  # a compute stream idle this long pays SimCost.wake_s at its next compute


# ---- the simulation ----------------------------------------------------------------------------
def simulate(programs: Iterable[Program], cost: SimCost, opportunistic: bool | None = None) -> SimResult:
    """Play `programs` (one per device) forward in time under `cost`.

    `opportunistic`: Varuna's run-time deviation (module docstring), as the runtime applies it:
    for programs that recompute (None), every program (True) or none (False: the static order).
    """
    return _Simulation(tuple(programs), cost, opportunistic).run()


class _Simulation(FairShareClock, VarunaDeviation, Interpreter):
    """Plays the programs forward in time; one handler per instruction kind starts it."""

    handlers = {
        Forward: "_start_compute", Recompute: "_start_compute", Backward: "_start_compute",
        InputGrad: "_start_compute", WeightGrad: "_start_compute", Update: "_start_compute", HostUpdate: "_start_compute", GradNormPart: "_count_norm_part",
        AllReduceShared: "_join_allreduce", AllReduceGradNorm: "_join_allreduce",
        Send: "_start_send", Recv: "_post_recv",
        SwapIn: "_start_swap", SwapOut: "_start_swap", Free: "_start_swap",
        StashIn: "_start_stash", StashOut: "_start_stash",
    }

    def __init__(self, programs: tuple[Program, ...], cost: SimCost, opportunistic: bool | None = None):
        devices = [p.device for p in programs]
        if len(set(devices)) != len(devices):
            raise PlanError(f"simulate expects one program per device, got devices {devices}")
        self.programs = {p.device: p for p in programs}
        self.cost = cost
        self.queues = {
            (d, s): deque(i for i, ins in enumerate(p.instructions) if ins.stream == s)
            for d, p in self.programs.items()
            for s in Stream
        }
        self.stage_device = {ins.stage: d for d, p in self.programs.items() for ins in p.instructions
                             if not isinstance(ins, (*ALL_REDUCES, GradNormPart))}
        self.started: dict[tuple[int, int], float] = {}
        self.finished: dict[tuple[int, int], float] = {}
        self.timers: list[tuple[float, int, Callable[[], None]]] = []
        self.flows: list[Flow] = []
        self.arrived: dict[tuple[MessageKey, ...], deque[float]] = defaultdict(deque)  # key -> start times of arrived flows
        self.waiting: dict[tuple[MessageKey, ...], deque[tuple[int, int]]] = defaultdict(deque)  # key -> posted recvs
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
        self.grads_held: set[int] = set()  # stages whose gradients are on their device (with cost.grad_bytes)
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
                if stream is Stream.COMPUTE and device in self.deviations and self._start_early(device, queue):
                    progressed = True
                if queue and (device, queue[0]) not in self.started and self._ready(device, queue[0]):
                    self._start(device, queue[0])
                    progressed = True
            for op in [op for op in self.adopted if self._ready(*op)]:
                self.adopted.remove(op)
                self._start(*op)
                progressed = True

    def _ready(self, device: int, index: int) -> bool:
        return all((device, j) in self.finished for j in self.programs[device].instructions[index].waits)

    # -- Varuna's opportunistic policy (§3.2), as runtime/executor.py applies it
    def _start(self, device: int, index: int) -> None:
        op = (device, index)
        self.started[op] = self.span_start[op] = self.now
        self.dispatch(device, index, self.programs[device].instructions[index])

    def _start_swap(self, device: int, index: int, ins: SwapIn | SwapOut | Free) -> None:
        """A swap moves its planned bytes over the device's host link; device memory follows it."""
        nbytes = self.cost.bytes_of(ins)
        if ins.state is State.GRADS and self.cost.grad_bytes:
            self._hold_grads(device, ins.stage, held=isinstance(ins, SwapIn))
            (self.swapped_in if isinstance(ins, SwapIn) else self.swapped_out)[device] += nbytes
        elif isinstance(ins, SwapIn):
            self.swapped_in[device] += nbytes
            # a stage whose state stays on the device (counted static) only refreshes it in place
            # (updated weights back from a host optimizer): link time, no memory
            if _at(self.cost.state_bytes, ins.stage) <= 0:
                self.memory[device].append((self.now, nbytes))
                self.resident_swap[(ins.stage, ins.state)] = nbytes
        else:
            self.swapped_out[device] += nbytes
            self.memory[device].append((self.now, -self.resident_swap.pop((ins.stage, ins.state), 0)))
        self._cross_host_link(device, index, ins)

    def _start_stash(self, device: int, index: int, ins: StashIn | StashOut) -> None:
        """One microbatch's stash (sX): back in now, out once copied (`_finish`). It moves the stash the
        cost model holds for the stage (what the device's memory counts too), not the plan's estimate."""
        nbytes = self.cost.bytes_of(ins)
        if isinstance(ins, StashIn):
            self.swapped_in[device] += nbytes
            self.memory[device].append((self.now, nbytes))
        else:
            self.swapped_out[device] += nbytes
        self._cross_host_link(device, index, ins)

    def _cross_host_link(self, device: int, index: int, ins: SwapIn | SwapOut | Free | StashIn | StashOut) -> None:
        """Its bytes flow over the device's host link, in fair share with the other swaps of that host
        in that direction; then the runtime's cost. A kind that crosses no link (Free) costs that alone."""
        if ins.facts.crosses is not Link.HOST:
            self._after(self.cost.instruction_s, (device, index))
            return
        inbound = ins.facts.activity is Activity.SWAP_IN
        link = HostLink(self.cost.host_of(device), inbound)
        self.flows.append(Flow(type(ins), link, self.cost.host_link(device), self.cost.bytes_of(ins), self.now,
                               (device, index)))

    def _start_compute(self, device: int, index: int, ins: Instruction) -> None:
        op = (device, index)
        if stashes(ins):
            self.memory[device].append((self.now, _at(self.cost.stash_bytes, ins.stage)))
        if isinstance(ins, _WHOLE_BACKWARD) and self.cost.grad_bytes:
            self._hold_grads(device, ins.stage, held=True)
        seconds = self.cost.compute_s(ins) * self.cost.slowed.get(device, 1.0) + self.cost.instruction_s
        shared = device in self.cost.shared_devices
        idle = self.now - self.computed_until.get(device, -math.inf) >= WAKE_IDLE_S
        if shared and ins.stream is Stream.COMPUTE and idle:
            seconds += self.cost.wake_s
        if shared and self.cost.concurrency:
            self.flows.append(Flow(type(ins), HOST, 1.0, seconds, self.now, op))
        else:
            self._after(seconds, op)

    def _hold_grads(self, device: int, stage: int, held: bool) -> None:
        """Gradients come onto the device with a stage's first backward (or their swap-in) and leave
        with its update (or their swap-out), as the runtime's pool counts them."""
        if held != (stage in self.grads_held):
            self.grads_held.symmetric_difference_update({stage})
            nbytes = _at(self.cost.grad_bytes, stage)
            self.memory[device].append((self.now, nbytes if held else -nbytes))

    def _count_norm_part(self, device: int, index: int, ins: GradNormPart) -> None:
        """A stage's squared gradient norm, counted while its gradients are at hand: no time of its own."""
        self._after(0.0, (device, index))

    def _start_send(self, device: int, index: int, ins: Send) -> None:
        nbytes = self.cost.bytes_of(ins)
        self.p2p[device] += nbytes
        bandwidth = self.cost.link_bandwidth(device, ins.peer)
        self.flows.append(Flow(message_keys(ins), self.cost.link(device, ins.peer), bandwidth, nbytes, self.now,
                                (device, index)))

    def _post_recv(self, device: int, index: int, ins: Recv) -> None:
        key = message_keys(ins)
        if self.arrived[key]:
            self._complete_recv((device, index), self.arrived[key].popleft())
        else:
            self.waiting[key].append((device, index))

    def _join_allreduce(self, device: int, index: int, ins: AllReduceShared | AllReduceGradNorm) -> None:
        op = (device, index)
        tag = (type(ins), ins.tensors if isinstance(ins, AllReduceShared) else (), ins.group)
        key = (*tag, self.seen[(op[0], tag)])
        self.seen[(op[0], tag)] += 1
        members = self.rendezvous[key]
        members.append(op)
        # groups list stages; each device joins once for all its member stages
        expected = len({self.stage_device.get(s, s) for s in ins.group})
        if len(members) == expected:
            duration = self.cost.allreduce_s(ins, sorted(device for device, _ in members))
            for member in members:
                self.span_start[member] = self.now
                self._after(duration, member)
            del self.rendezvous[key]

    def _after(self, duration: float, op: tuple[int, int]) -> None:
        self._later(duration, lambda: self._finish(op))

    # -- finishing instructions
    def _finish(self, op: tuple[int, int]) -> None:
        device, index = op
        ins = self.programs[device].instructions[index]
        self.finished[op] = self.now
        self._dequeue(device, ins.stream, index)
        if isinstance(ins, COMPUTES):
            self.computed_until[device] = self.now
        if isinstance(ins, (Update, HostUpdate)) and self.cost.grad_bytes:
            self._hold_grads(device, ins.stage, held=False)
        if isinstance(ins, (*_WHOLE_BACKWARD, StashOut)):
            self.memory[device].append((self.now, -_at(self.cost.stash_bytes, ins.stage)))
        if isinstance(ins, (InputGrad, WeightGrad)):  # the gradients B records for W
            held = _at(self.cost.recorded_bytes, ins.stage)
            self.memory[device].append((self.now, held if isinstance(ins, InputGrad) else -held))
        if isinstance(ins, _WHOLE_BACKWARD):
            self.memory[device].append((self.now, -self.buffers.pop((device, ins.stage, ins.microbatch), 0.0)))

    def _dequeue(self, device: int, stream: Stream, index: int) -> None:
        """A finished instruction leaves its stream's queue: the head, or one taken out of the queue
        when it started out of order (Varuna's early forward, its receives and sends)."""
        queue = self.queues[(device, stream)]
        if queue and queue[0] == index:
            queue.popleft()
        else:
            assert index not in queue, (device, stream, index)

    def _deliver(self, flow: Flow) -> None:
        """The data of a send has arrived: the send finishes, and so does a recv waiting for it. What
        arrived occupies a transfer buffer on the receiver from now (the runtime's mailbox holds it
        whether or not the receive is posted) until the receiving stage's backward of that microbatch."""
        self._finish(flow.send)
        send, key = self.programs[flow.send[0]].instructions[flow.send[1]], flow.key
        assert isinstance(send, Send) and isinstance(key, tuple), send  # a compute's flow finishes in _advance
        nbytes = self.cost.bytes_of(send)
        if nbytes:
            self.memory[send.peer].append((self.now, nbytes))
            self.buffers[(send.peer, send.peer_stage, send.microbatch)] += nbytes
        if self.waiting[key]:
            self._complete_recv(self.waiting[key].popleft(), flow.start)
        else:
            self.arrived[key].append(flow.start)

    def _complete_recv(self, op: tuple[int, int], flow_start: float) -> None:
        """The recv's span covers the data moving, not the wait before the sender started."""
        self.span_start[op] = min(max(self.started[op], flow_start), self.now)
        self._finish(op)

    def _stuck(self) -> str:
        heads = [
            f"dev{d} {s}: {self.programs[d].instructions[q[0]]}" for (d, s), q in self.queues.items() if q
        ]
        return "; ".join(heads)

    # -- the result
    def _result(self) -> SimResult:
        spans = sorted((self._span(op) for op in self.finished), key=span_order)
        end = max((s.end for s in spans), default=0.0)
        devices = sorted(self.programs)
        busy = {
            d: sum(s.end - s.start for s in spans if s.device == d and isinstance(s.instruction, (*COMPUTES, HostUpdate)))
            for d in devices
        }
        memory = {d: occupancy(self.memory[d], self._static_bytes(d)) for d in devices}
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
        stages = {ins.stage for ins in self.programs[device].instructions}
        return sum(_at(self.cost.state_bytes, s) for s in stages)


