"""Varuna's opportunistic policy in the simulator, as runtime/executor.py applies it.

Varuna §3.2, for programs that recompute: when a device's next compute is a recompute R(m), or a backward B(m) no recompute precedes,
whose gradient has not arrived, and the first later forward F(k) is ready (its activations
arrived, its other dependencies done; no update, all-reduce or swap between the two), F(k)
starts first; its receives complete at once and its sends start as it ends, outside
p2p_out's order. The simulator has no memory capacity, so the runtime's headroom check (one
more stash must fit in the pool) has no counterpart here. `simulate(..., opportunistic=False)`
predicts the static order.
"""

from __future__ import annotations

from collections import deque

from stagewise.ir.deviations import DeviationPoints
from stagewise.ir.instructions import MessageKey, Recv, Stream, message_keys
from stagewise.ir.program import Program


class VarunaDeviation:
    """The simulator's side of the policy: start a ready forward ahead of a backward whose gradient is late;
    the simulation (passes/simulate.py) supplies the state below, `_ready` and `_start`."""

    programs: dict[int, Program]
    queues: dict[tuple[int, Stream], deque[int]]
    started: dict[tuple[int, int], float]
    finished: dict[tuple[int, int], float]
    arrived: dict[tuple[MessageKey, ...], deque[float]]
    deviations: dict[int, DeviationPoints]
    adopted: list[tuple[int, int]]

    def _ready(self, device: int, index: int) -> bool:
        raise NotImplementedError

    def _start(self, device: int, index: int) -> None:
        raise NotImplementedError

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
                self.queues[(device, Stream.P2P_IN)].remove(r)
                self._start(device, r)
        out = self.queues[(device, Stream.P2P_OUT)]
        for s in plan.act_sends[early]:
            if out[0] != s:  # p2p_out has not reached it (the runtime's thread would own it)
                out.remove(s)
                self.adopted.append((device, s))
        assert self._ready(device, early), code[early]
        self._start(device, early)
        return True

    def _grad_arrived(self, device: int, plan: DeviationPoints, head: int) -> bool:
        return all((device, g) in self.finished or self._message_waits(device, g) for g in plan.grad_recvs[head])

    def _message_waits(self, device: int, recv: int) -> bool:
        """Whether a message for the receive `recv` has arrived and no posted receive took it yet."""
        ins = self.programs[device].instructions[recv]
        assert isinstance(ins, Recv), ins
        return bool(self.arrived[message_keys(ins)])

    def _ready_early(self, device: int, plan: DeviationPoints, early: int) -> bool:
        """Its other dependencies are done and each activation receive is done or, not yet posted, has
        its message (a posted receive completes the moment its message arrives)."""
        recvs = plan.act_recvs[early]
        if not all((device, j) in self.finished for j in self.programs[device].instructions[early].waits if j not in recvs):
            return False
        return all((device, r) in self.finished
                   or ((device, r) not in self.started and self._message_waits(device, r))
                   for r in recvs)
