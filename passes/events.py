"""Events: which earlier instructions of other streams each instruction of a program waits for.

A stream runs its own instructions in order; across streams of one device the lowered program
states its dependencies as events (Harmony §4.4), derived here from what each instruction reads
and writes, so the runtime's threads (or CUDA streams) and the simulator wait for the same ones.
"""

from __future__ import annotations

from dataclasses import replace

from stagewise.ir.instruction_facts import Activity, StashUse
from stagewise.ir.instructions import Carried, Instruction, Stream, microbatch_of
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


def _waits_for(ins: Instruction, prev: Instruction) -> bool:
    """Whether `ins` depends on the earlier `prev` of another stream (the rules of `with_events`),
    read from the two kinds' facts (ir/instruction_facts.py)."""
    now, before = ins.facts, prev.facts
    same = prev.stage == ins.stage and microbatch_of(prev) == microbatch_of(ins)
    if now.stash is StashUse.MOVES_OUT:  # after the forward that stashed it and the sends that read its outputs
        return same and (before.stash is StashUse.RECORDS
                         or (before.activity is Activity.SEND and prev.message is Carried.ACTIVATIONS))
    if now.stash is StashUse.MOVES_IN:
        return same and before.stash is StashUse.MOVES_OUT  # back only once it is out
    if before.stash in (StashUse.MOVES_OUT, StashUse.MOVES_IN):  # (the residency bound is explicit)
        return before.stash is StashUse.MOVES_IN and now.stash is StashUse.READS and same
    if before.brings_state and now.needs_state:
        # state must be on the device (an all-reduce or a norm part waits for every swap-in before it)
        return prev.stage == ins.stage or now.all_stages
    if now.evicts_state:  # evict after the work that used or changed it
        return prev.stream is Stream.COMPUTE or (before.brings_state and prev.stage == ins.stage)
    if now.brings_state:  # after this stage's earlier evictions (and the buffering-depth event)
        # a host update changed the master it copies in; a device update the weights it evicted
        return before.changes_state and prev.stage == ins.stage
    if now.consumes is not None:  # a recompute re-runs a forward on inputs it already has
        return same and before.activity is Activity.RECEIVE and prev.message is now.consumes
    if now.activity is Activity.SEND:
        return same and before.makes is ins.message
    return now.fence


def _latest_per_stream(waits: tuple[int, ...], code) -> tuple[int, ...]:
    """Waiting for the last awaited instruction of a stream implies the earlier ones (FIFO)."""
    latest: dict[Stream, int] = {}
    for j in waits:
        latest[code[j].stream] = max(j, latest.get(code[j].stream, -1))
    return tuple(sorted(latest.values()))
