"""Simulated time: timers, and transfers and shared-host computes that progress in fair share.

Transfers in flight on one link share its bandwidth fairly, and computes of devices that share a
host share its cores the same way; every finish time is recomputed whenever one starts or ends
(Srifty §4.3's fair-share simulator). The simulation (passes/simulate.py) decides what a finished
flow means.
"""

from __future__ import annotations

import functools
import heapq
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

from stagewise.ir.instructions import HostUpdate, Instruction, MessageKey, Update
from stagewise.passes.sim_cost import SimCost

_EPS = 1e-12


@dataclass(frozen=True)
class HostLink:
    """The link key of swaps between the devices of one host and its memory, one per direction."""

    host: int
    inbound: bool


@dataclass
class Flow:
    """A transfer in flight: the bytes still to move on its link."""

    key: tuple[MessageKey, ...] | type[Instruction]  # the messages a transfer carries; a compute's instruction type
    link: tuple[int, int] | tuple[str] | HostLink  # devices (src, dst), HOST for a compute, or a host link
    bandwidth: float
    remaining: float
    start: float
    send: tuple[int, int]  # the instruction that ends when the flow has drained


HOST: tuple[str] = ("host",)  # the link key of computes sharing one host


class FairShareClock:
    """Timers and flows in fair share; the simulation supplies `cost`, `_finish` and `_deliver`."""

    cost: SimCost
    now: float
    timers: list[tuple[float, int, Callable[[], None]]]
    flows: list[Flow]
    _seq: int

    def _finish(self, op: tuple[int, int]) -> None:
        raise NotImplementedError

    def _deliver(self, flow: Flow) -> None:
        raise NotImplementedError

    def _later(self, delay: float, action: Callable[[], None]) -> None:
        """Run `action` `delay` seconds from now (at once when the delay is zero)."""
        if delay <= 0:
            action()
            return
        self._seq += 1
        heapq.heappush(self.timers, (self.now + delay, self._seq, action))

    def _rates(self) -> list[float]:
        """Fair share: each flow gets its link's bandwidth divided by the flows on that link; a
        compute on a shared host gets its speed with as many computes running."""
        count: dict[tuple | HostLink, int] = defaultdict(int)
        for flow in self.flows:
            count[flow.link] += 1
        computing = count[HOST]
        return [self.cost.speed_with(computing, update=flow.key in (Update, HostUpdate)) if flow.link == HOST
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
            if flow.link == HOST:
                self._finish(flow.send)
            elif isinstance(flow.link, HostLink):  # a swap: on the host, no network latency
                self._later(self.cost.instruction_s, functools.partial(self._finish, flow.send))
            else:
                latency = self.cost.latency_s + self.cost.instruction_s
                self._later(latency, functools.partial(self._deliver, flow))
        while self.timers and self.timers[0][0] <= t + _EPS * max(1.0, abs(t)):
            heapq.heappop(self.timers)[2]()
