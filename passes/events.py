"""Events: which earlier instructions of other streams each instruction of a program waits for.

A stream runs its own instructions in order; across streams of one device the lowered program
states its dependencies as events (Harmony §4.4), derived here from what each instruction reads
and writes, so the runtime's threads (or CUDA streams) and the simulator wait for the same ones.
"""

from __future__ import annotations

from dataclasses import replace

from stagewise.ir.instructions import (
    AllReduceGradNorm,
    AllReduceShared,
    Backward,
    Carried,
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
from stagewise.ir.program import Program


def with_events(program: Program) -> Program:
    """State each instruction's intra-device dependencies as events (indices it waits for).

    A forward waits for its activations' receives, a backward for its forward and its
    gradients' receives (and its stash's swap-in), a send for the compute that made what it
    sends, a stash's swap-out for its forward and sends, its swap-in for that swap-out;
    all-reduces and the update wait for everything before them but stash swaps. Only waits
    across streams are listed: a stream runs its own instructions in order.
    """
    code = program.instructions
    events = []
    for i, ins in enumerate(code):
        derived = [j for j in range(i) if code[j].stream != ins.stream and _waits_for(ins, code[j])]
        explicit = [j for j in ins.waits if code[j].stream != ins.stream]
        events.append(replace(ins, waits=_latest_per_stream(tuple(derived + explicit), code)))
    return replace(program, instructions=tuple(events))


_RECEIVED = {Forward: Carried.ACTIVATIONS, Backward: Carried.GRADIENTS}
_PRODUCED_BY = {Carried.ACTIVATIONS: Forward, Carried.GRADIENTS: Backward}


def _waits_for(ins: Instruction, prev: Instruction) -> bool:
    """Whether `ins` depends on the earlier `prev` of another stream (the rules of `with_events`)."""
    same = prev.stage == ins.stage and _microbatch(prev) == _microbatch(ins)
    if isinstance(ins, StashOut):  # after the forward that stashed it and the sends that read its outputs
        return same and (isinstance(prev, (Forward, Recompute))
                         or (isinstance(prev, Send) and prev.carries is Carried.ACTIVATIONS))
    if isinstance(ins, StashIn):
        return same and isinstance(prev, StashOut)  # back only once it is out
    if isinstance(prev, (StashIn, StashOut)):  # (the residency bound is explicit)
        return isinstance(prev, StashIn) and isinstance(ins, Backward) and same
    if isinstance(prev, SwapIn) and isinstance(ins, (Forward, Recompute, Backward, Update, GradNormPart,
                                                    AllReduceShared, AllReduceGradNorm, HostUpdate)):
        # state must be on the device (an all-reduce or a norm part waits for every swap-in before it)
        return prev.stage == ins.stage or isinstance(ins, (AllReduceShared, AllReduceGradNorm, GradNormPart))
    if isinstance(ins, (SwapOut, Free)):  # evict after the work that used or changed it
        return prev.stream is Stream.COMPUTE or (isinstance(prev, SwapIn) and prev.stage == ins.stage)
    if isinstance(ins, SwapIn):  # after this stage's earlier evictions (and the buffering-depth event)
        # a host update changed the master it copies in; a device update the weights it evicted
        return isinstance(prev, (SwapOut, Free, HostUpdate, Update)) and prev.stage == ins.stage
    if isinstance(ins, (Forward, Backward)):  # a recompute re-runs a forward on inputs it already has
        return same and isinstance(prev, Recv) and prev.carries is _RECEIVED[type(ins)]
    if isinstance(ins, Send):
        return same and isinstance(prev, _PRODUCED_BY[ins.carries])
    return isinstance(ins, (AllReduceShared, AllReduceGradNorm, GradNormPart, Update, Recompute, HostUpdate))


def _microbatch(ins: Instruction) -> int | None:
    return getattr(ins, "microbatch", None)


def _latest_per_stream(waits: tuple[int, ...], code) -> tuple[int, ...]:
    """Waiting for the last awaited instruction of a stream implies the earlier ones (FIFO)."""
    latest: dict[Stream, int] = {}
    for j in waits:
        latest[code[j].stream] = max(j, latest.get(code[j].stream, -1))
    return tuple(sorted(latest.values()))
