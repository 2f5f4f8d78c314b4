"""Streams without a thread of their own: their next instruction runs on the thread that made it ready.

On a CPU device whose messages travel in this process's memory, a send is one small copy into
the receiver's buffer and a receive whose message is in the mailbox takes it out: both are
shorter than the thread hand-off that a thread of their own costs (a wake-up and a pass of the
GIL, twice per message: the sender's compute to its p2p_out thread, that thread to the
receiver's p2p_in thread, that one to the receiver's compute). So there the p2p streams have
no thread: whichever thread completes the last thing one of their instructions waits for (an
event of its device, its message, the stream's previous instruction) runs it right away. What
runs is the same: each stream's instructions in program order, one at a time, each after its
events and (a receive) its messages; only the thread differs.

The same holds for the swap streams of a CPU device (issue 23: a CPU device keeps one compute
thread): there a swap is a copy in host memory, as synchronous as the compute, so a thread of its
own would only add hand-offs. Their instructions wait for events of the device alone, so the
thread that finishes the last of those (mostly the device's compute thread) runs them at once.
"""

from __future__ import annotations

from collections.abc import Callable

from stagewise.ir.instructions import Stream
from stagewise.ir.program import Program
from stagewise.runtime.tables import ProgramTables

# the streams that may do without a thread: their instructions never block (a receive runs once its
# message arrived); the executor says which are threadless on which device (runtime/executor.py)
P2P = (Stream.P2P_IN, Stream.P2P_OUT)
SWAPS = (Stream.SWAP_IN, Stream.SWAP_OUT)
THREADLESS = P2P + SWAPS


class ThreadlessStreams:
    """One device's threadless streams in one step: per lane (a stream of `THREADLESS`) its
    instructions if it is threadless this step, the position of the next, and whether one is
    running. Read and changed only under the `Sync` lock; asked after every instruction of the
    device, so it compares and indexes rather than hashes (an enum's hash is Python code)."""

    def __init__(self, program: Program, tables: ProgramTables, streams: tuple[Stream, ...]):
        self.streams = streams
        self.orders = [tables.order[stream] if stream in streams else [] for stream in THREADLESS]
        self.positions = [0] * len(THREADLESS)
        self.running = [False] * len(THREADLESS)
        self.code = program.instructions
        self.incoming = tables.incoming

    def claim(self, done: list[bool], arrived: Callable[[tuple], bool]) -> int | None:
        """The next instruction of an idle stream if it is ready (its events `done`, its messages
        `arrived`): it is then running on the caller's thread."""
        for lane, order in enumerate(self.orders):
            position = self.positions[lane]
            if self.running[lane] or position == len(order):
                continue
            index = order[position]
            if all([done[j] for j in self.code[index].waits]) and all([arrived(key) for key in self.incoming[index]]):
                self.positions[lane] = position + 1
                self.running[lane] = True
                return index
        return None

    def finished(self, stream: Stream) -> None:
        """An instruction of `stream` returned (any stream of the device may be reported)."""
        for lane, threadless in enumerate(THREADLESS):
            if stream is threadless:
                self.running[lane] = False

    def unrun(self) -> list[int]:
        """The instructions no thread ran (their events or messages never came)."""
        return sorted(i for lane, order in enumerate(self.orders) for i in order[self.positions[lane]:])
