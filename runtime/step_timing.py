"""What one step's stream threads did with their time, recorded where the executor already passes.

A user must be able to tell a slow model from a slow runtime, so each stream thread keeps, for
the step it runs, a `ThreadClock`: when its job began and ended, the seconds it was blocked on a
dependency (in `Sync`, for an event, a message or an all-reduce partner; under torch.distributed
also on the network, runtime/distributed.py), and the seconds of the instructions it ran, net of
the blocked seconds inside them (a receive or an all-reduce waits inside its instruction). Only
its own thread writes a clock, so nothing is locked; the executor finds the running thread's clock
in a thread-local (`THREAD.clock`), and so does the monitor when it blocks. The step keeps every
instruction's net seconds (`StepTimes.net`, by device and index), written once by whichever thread
ran it. Everything else (the split per device, runtime/device_time.py) is derived after the step.

The cost on the path of every instruction is a thread-local read, a subtraction and one call that
stores the net seconds and adds them to the clock (well under a microsecond; no allocation but the
floats); a blocked wait adds two `perf_counter` calls, a wait that is ready at once nothing.
"""

from __future__ import annotations

import threading
import time

from stagewise.ir.instructions import Stream
from stagewise.ir.program import Program


class ThreadClock:
    """One stream thread in one step: written by that thread only, read after the step."""

    __slots__ = ("device", "stream", "began", "ended", "waited_s", "own_s", "other_s")

    def __init__(self, device: int, stream: Stream):
        self.device = device  # the thread's device and stream (it may run other streams' threadless instructions)
        self.stream = stream
        self.began = time.perf_counter()  # its job started (perf_counter)
        self.ended: float | None = None  # its job returned; None while it runs (or if it never returned)
        self.waited_s = 0.0  # blocked on a dependency, inside instructions or between them
        self.own_s = 0.0  # instructions of its own stream, net of the waits inside them
        self.other_s = 0.0  # instructions of other streams it ran for them (threadless p2p, Varuna's receives)

    def ran(self, times: StepTimes, device: int, index: int, stream: Stream, net_s: float) -> None:
        """Instruction `index` of `device`, on `stream`, ran on this thread for `net_s` seconds not blocked."""
        times.net[device][index] = net_s
        if stream is self.stream and device == self.device:
            self.own_s += net_s
        else:
            self.other_s += net_s


class _Current(threading.local):
    """The clock of the step the calling thread runs; None on a thread that runs no step."""

    clock: ThreadClock | None = None


THREAD = _Current()


def waited_since(began: float) -> None:
    """The calling thread was blocked on a dependency since `began` (perf_counter): charge it to its clock."""
    clock = THREAD.clock
    if clock is not None:
        clock.waited_s += time.perf_counter() - began


class StepTimes:
    """One step's timing: its launch, each instruction's net seconds, and every stream thread's clock."""

    def __init__(self, programs: tuple[Program, ...] = ()):
        self.started_at = time.perf_counter()  # the step's launch
        self.net = {p.device: [0.0] * len(p.instructions) for p in programs}
        self.threads: list[ThreadClock] = []  # one per stream thread of the step, in the order they began

    def thread_began(self, device: int, stream: Stream) -> ThreadClock:
        """The calling thread starts its job of the step: its clock, which the thread-local now names."""
        clock = ThreadClock(device, stream)
        self.threads.append(clock)  # list.append is atomic: threads begin concurrently
        THREAD.clock = clock
        return clock

    @staticmethod
    def thread_ended(clock: ThreadClock) -> None:
        """The calling thread's job returned (its instructions done, or the step failed)."""
        clock.ended = time.perf_counter()
        THREAD.clock = None

    def ended_at(self) -> float:
        """The step's end: the last stream thread's return (its launch if none ran; now if one has not returned)."""
        if any(clock.ended is None for clock in self.threads):
            return time.perf_counter()
        return max((clock.ended for clock in self.threads if clock.ended is not None), default=self.started_at)
