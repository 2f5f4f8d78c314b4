"""Every device of this process on one thread, walking one order computed when the programs load.

On in-process CPU devices an instruction's kernels run on the thread that issues it, so where the
devices cannot compute in parallel anyway (one device, or a process allowed one core) a thread
per device buys nothing and costs a thread hand-off (a wake-up and a pass of the GIL) at every
wait, dozens a step (issue 23: lower once, run many). There one thread runs every instruction, in
an order fixed at load (`serial_order`: each stream in program order, each instruction after its
events and, a receive, after the sends of its messages; the devices taking turns, as their threads
would), so a step is one walk down a flat list of prebound calls: no wait, lock hand-off, readiness
check or dispatch per instruction. The walk records what the stream threads record (the started
and done flags, the timeline, each device's clock) so failures, `pipe.time_breakdown()` and the
tests read it alike. Where no such order exists (an all-reduce between devices, whose partners
block; a program that deadlocks) the threads run the step as before, and report the deadlock.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping

from stagewise.ir.instructions import AllReduceGradNorm, AllReduceShared, Send, Stream
from stagewise.ir.program import Program
from stagewise.runtime.step_timing import StepTimes, ThreadClock
from stagewise.runtime.sync import Aborted, Sync
from stagewise.runtime.tables import ProgramTables

Position = tuple[int, int]  # (device, instruction index)
_OTHERS = tuple(stream for stream in Stream if stream is not Stream.COMPUTE)
# a device's turn: its swaps and messages that are ready, one compute instruction, then those it made ready
_TURN = (*_OTHERS, Stream.COMPUTE, *_OTHERS)


def one_core() -> bool:
    """Whether this process may run on one CPU only: its devices' threads could not compute in parallel."""
    return len(os.sched_getaffinity(0)) == 1 if hasattr(os, "sched_getaffinity") else False


def serial_order(programs: tuple[Program, ...], tables: Mapping[int, ProgramTables],
                 device_of: Mapping[int, int]) -> tuple[Position, ...] | None:
    """A legal order of every instruction of `programs` on one thread, or None where there is none: an
    all-reduce between devices (its members block until all joined), or programs that deadlock."""
    if any(isinstance(ins, (AllReduceShared, AllReduceGradNorm)) and len({device_of[s] for s in ins.group}) > 1
           for program in programs for ins in program.instructions):
        return None
    code = {p.device: p.instructions for p in programs}
    heads = {(device, stream): 0 for device in code for stream in Stream}
    done = {device: [False] * len(instructions) for device, instructions in code.items()}
    sent: set[tuple] = set()
    order: list[Position] = []

    def ready(device: int, stream: Stream) -> int | None:
        """The stream's next instruction if it may run now."""
        queue, head = tables[device].order[stream], heads[(device, stream)]
        if head == len(queue):
            return None
        index = queue[head]
        ins = code[device][index]
        if all(done[device][j] for j in ins.waits) and all(key in sent for key in tables[device].incoming[index]):
            return index
        return None

    def run(device: int, stream: Stream, index: int) -> None:
        heads[(device, stream)] += 1
        done[device][index] = True
        order.append((device, index))
        if isinstance(code[device][index], Send):
            sent.update(key for _, key in tables[device].messages[index])

    total = sum(len(instructions) for instructions in code.values())
    while len(order) < total:
        progressed = False
        for device in code:  # a turn each, as the devices' threads would take turns on one core
            for stream in _TURN:
                budget = 1 if stream is Stream.COMPUTE else len(code[device])
                while budget and (index := ready(device, stream)) is not None:
                    run(device, stream, index)
                    budget, progressed = budget - 1, True
        if not progressed:
            return None
    return tuple(order)


class SerialWalk:
    """One step of the programs on the calling thread, in the order `serial_order` fixed."""

    def __init__(self, order: tuple[Position, ...], tables: Mapping[int, ProgramTables]):
        self.devices = sorted(tables)
        slot = {device: n for n, device in enumerate(self.devices)}
        # each position with what running it reads, resolved once: its device's slot in the walk's
        # per-device lists, its stream, whether that is the device's compute stream, its prebound call
        self.entries = [(device, slot[device], index, tables[device].stream[index],
                         tables[device].stream[index] is Stream.COMPUTE, tables[device].calls[index])
                        for device, index in order]

    def run(self, times: StepTimes, done: Mapping[int, list[bool]], started: Mapping[int, list[bool]],
            timeline: list, sync: Sync, blame: Callable[[BaseException, int, int], None]) -> None:
        """Run every instruction, recording what stream threads record: the flags, the timeline, a
        compute-thread clock per device whose waiting is the time the walk spent on other devices.
        Stops once `sync` failed (the caller's deadline passed)."""
        clocks = [ThreadClock(device, Stream.COMPUTE) for device in self.devices]
        times.threads.extend(clocks)
        devices = len(clocks)
        own, other, dispatch = [0.0] * devices, [0.0] * devices, [0.0] * devices  # seconds, per device slot
        ended: list[float | None] = [None] * devices
        net, step_began = times.net, times.started_at
        began = last = time.perf_counter()
        try:
            for device, slot, index, stream, compute, call in self.entries:
                if sync.error is not None:
                    raise Aborted
                start = time.perf_counter()
                started[device][index] = True
                try:
                    call()
                except BaseException as error:
                    blame(error, device, index)
                    raise
                last = ended[slot] = time.perf_counter()
                seconds = net[device][index] = last - start
                if compute:
                    own[slot] += seconds
                else:
                    other[slot] += seconds
                dispatch[slot] += start - began  # the walk's own time before the instruction
                began = last
                timeline.append((device, stream, index, start - step_began, last - step_began))
                done[device][index] = True
        finally:
            for slot, clock in enumerate(clocks):
                clock.own_s, clock.other_s = own[slot], other[slot]
                returned = ended[slot]
                clock.ended = returned = last if returned is None else returned
                clock.waited_s = max(0.0, returned - clock.began - own[slot] - other[slot] - dispatch[slot])
