"""Where a device program may run a later forward early (Varuna §3.2), for the runtime and the simulator.

Varuna keeps to its static schedule except when the next task is a backward whose gradient has
not arrived: then it runs another ready task, a forward, and never one between a recompute
and its backward (rule 2). Both the executor and the simulator apply that rule to the same
instructions, so they read the deviation points from this one analysis.
"""

from __future__ import annotations

from collections import defaultdict

from stagewise.ir.instruction_facts import Activity
from stagewise.ir.instructions import Carried, Instruction, Stream, microbatch_of
from stagewise.ir.program import Program

_WORK = (Activity.FORWARD, Activity.RECOMPUTE, Activity.BACKWARD)  # a stage's work on one microbatch
_BACKWARD_SIDE = (Activity.RECOMPUTE, Activity.BACKWARD)


class DeviationPoints:
    """`compute`: the compute stream's instructions in order. `grad_recvs` (its keys: the heads):
    recomputes, and backwards no recompute of theirs precedes, each with the receives of its
    gradient; a head without any never waits for a gradient. `act_recvs` / `act_sends`: each
    forward's activation receives and sends, which the compute stream takes over when it runs the
    forward early (`adoptable`). `barriers[i]`: how many updates, all-reduces and swaps come before
    instruction i (a forward never moves past one)."""

    def __init__(self, program: Program):
        code = program.instructions
        self.compute = [i for i, ins in enumerate(code) if ins.stream is Stream.COMPUTE]
        messages: dict[tuple[Activity, Carried, int, int | None], list[int]] = defaultdict(list)
        for i, ins in enumerate(code):
            if ins.message is not None:
                messages[(ins.facts.activity, ins.message, ins.stage, microbatch_of(ins))].append(i)
        work = {i: ins for i in self.compute if (ins := code[i]).facts.activity in _WORK}
        recomputes = [ins for ins in work.values() if ins.facts.activity is Activity.RECOMPUTE]
        self.recomputes = bool(recomputes)
        self.backward = {i for i, ins in work.items() if ins.facts.activity in _BACKWARD_SIDE}
        recomputed = {_unit(ins) for ins in recomputes}
        self.grad_recvs: dict[int, tuple[int, ...]] = {}
        for i in self.backward:
            ins = work[i]
            grads = tuple(messages[(Activity.RECEIVE, Carried.GRADIENTS, *_unit(ins))])
            if grads and (ins.facts.activity is Activity.RECOMPUTE or _unit(ins) not in recomputed):
                self.grad_recvs[i] = grads
        self.heads = set(self.grad_recvs)
        self.act_recvs: dict[int, tuple[int, ...]] = {}
        self.act_sends: dict[int, tuple[int, ...]] = {}
        for i, ins in work.items():
            if ins.facts.activity is Activity.FORWARD:
                unit = _unit(ins)
                self.act_recvs[i] = tuple(j for j in messages[(Activity.RECEIVE, Carried.ACTIVATIONS, *unit)] if j < i)
                self.act_sends[i] = tuple(j for j in messages[(Activity.SEND, Carried.ACTIVATIONS, *unit)] if j > i)
        self.adoptable = {j for i in self.act_recvs for j in self.act_recvs[i] + self.act_sends[i]}
        self.barriers, count = [], 0
        for ins in code:
            self.barriers.append(count)
            count += ins.facts.pins_forwards

    def candidate(self, pending: list[int]) -> int | None:
        """The forward that may run before `pending[0]`: the first later one, if the head may be
        overtaken and only recomputes and backwards lie between them (no update, all-reduce or swap)."""
        head = pending[0]
        if head not in self.grad_recvs:
            return None
        for index in pending[1:]:
            if index in self.act_recvs:
                return index if self.barriers[index] == self.barriers[head] else None
            if index not in self.backward:
                return None
        return None


def _unit(ins: Instruction) -> tuple[int, int | None]:
    """The stage and microbatch an instruction works on."""
    return ins.stage, microbatch_of(ins)
