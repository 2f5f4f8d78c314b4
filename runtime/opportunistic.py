"""Varuna's opportunistic policy for the executor's compute stream.

Varuna §3.2: "the schedule for stage k may indicate that the backward pass for micro-batch m
must be scheduled, but the gradients for m may not have arrived yet from stage k+1; in those
cases, Varuna deviates from the schedule and opportunistically schedules another ready task".
In programs that recompute (Varuna's schedule; `opportunistic` turns it on or off), when the
compute stream's next instruction is a recompute R(m), or a backward B(m) no recompute
precedes, and m's gradient has neither been received nor waits in the transport, the first
later forward F(k) runs first if it is ready: its other events are done, its activations have
arrived, and the device's pool has room for one more stash of its stage (the last one's size).
Varuna's runtime makes the same check at a recompute (microsoft/varuna, pipeline.py: "run
forward if gradients for backward are not ready yet"). Between R(m) and B(m) nothing moves in
(rule 2: a forward would hold a second set of activations), a forward never moves past an
update, all-reduce or swap, and forwards keep their order; backwards keep theirs, so gradients
accumulate in the same order and training is bitwise that of the static order. The p2p_in
thread receives in program order and sits in the receive of m's gradient while F(k)'s
activation waits in the mailbox, so the compute thread takes F(k)'s receives over (claimed
under the `Sync` lock, `owner`; the p2p_in thread skips what the compute thread took) and, as
Varuna's separate activation sender does, sends F(k)'s outputs right after it (sends never
block; the p2p_out thread skips them too), instead of behind the gradient sends that precede
them in program order. Under torch.distributed the compute thread posts the activation's
receive itself to learn whether it came: gloo matches messages by tag, so that is safe from any
thread; with NCCL (issue order) the policy is off.
`ExecutorState.step.deviations` lists what ran early in the last step.

Such programs keep a thread for each stream (no threadless p2p streams: runtime/threadless.py).
`OpportunisticCompute` reads the executor's state (runtime/executor_state.py: the step's monitor,
done flags and claims, the program tables) and runs instructions through the `run` it is given.
"""

from __future__ import annotations

from collections.abc import Callable

from stagewise.ir.deviations import DeviationPoints
from stagewise.ir.instructions import Forward, Stream
from stagewise.ir.program import Program
from stagewise.runtime.executor_state import ExecutorState

RunInstruction = Callable[[Program, int, Stream], None]  # the executor's: wait for its events, execute it


class OpportunisticCompute:
    """The compute stream of a program that may deviate (Varuna §3.2), and the claims the p2p threads respect."""

    def __init__(self, state: ExecutorState):
        self.state = state

    def opportunities(self, program: Program) -> DeviationPoints | None:
        """The program's deviation points, if the policy applies to it this step (`ExecutorState.opportunistic`)."""
        state = self.state
        if state.opportunistic is False or not state.transport.adopts_receives:
            return None
        if program.device not in state.deviation_points:
            state.deviation_points[program.device] = DeviationPoints(program)
        plan = state.deviation_points[program.device]
        return plan if plan.heads and (state.opportunistic or plan.recomputes) else None

    def claim(self, device: int, index: int, stream: Stream) -> bool:
        """Take instruction `index` for `stream` unless another stream took it first; True if it is `stream`'s."""
        step = self.state.step
        owner = step.owner[device]
        with step.sync.locked():
            return owner.setdefault(index, stream) == stream

    def compute(self, program: Program, plan: DeviationPoints, run: RunInstruction) -> None:
        """The compute stream in program order, except that when its next instruction is a backward
        (or the recompute before it) whose gradient has not arrived, a later forward that is ready
        runs first, with its receives and sends (Varuna §3.2). `run` runs one instruction on it."""
        step, code, tables = self.state.step, program.instructions, self.state.tables[program.device]
        done, owner = step.done[program.device], step.owner[program.device]
        pending = list(plan.compute)
        while pending:
            head = pending[0]
            for r in plan.act_recvs.get(head, ()):  # receives it took earlier to look at their messages
                if owner.get(r) is Stream.COMPUTE and not done[r]:
                    run(program, r, Stream.COMPUTE)
            early = plan.candidate(pending)
            keys = list(tables.waits_on[head])
            if early is not None:
                keys += [tables.done_key[j] for j in code[early].waits + plan.act_recvs[early] + plan.grad_recvs[head]]
                keys += [("message", key) for r in plan.act_recvs[early] + plan.grad_recvs[head]
                         for key in tables.incoming[r]]
            choice: int | None = None

            def decide(head: int = head, early: int | None = early) -> bool:
                nonlocal choice
                if early is not None and not self._grad_arrived(program, plan, head) and self._ready_early(program, plan, early):
                    choice = early
                else:
                    choice = head if all(done[j] for j in code[head].waits) else None
                return choice is not None

            step.sync.wait_until(decide, tables.labels[head], keys)
            assert choice is not None  # wait_until returns only once `decide` chose
            pending.remove(choice)
            if choice == head:
                run(program, head, Stream.COMPUTE)
            else:
                self._run_early(program, plan, choice, head, run)
            chosen = code[choice]
            if isinstance(chosen, Forward):
                self._note_stash(chosen)

    def _grad_arrived(self, program: Program, plan: DeviationPoints, head: int) -> bool:
        """Whether the gradient `head`'s backward needs has been received or waits in the transport."""
        done, tables, transport = self.state.step.done[program.device], self.state.tables[program.device], self.state.transport
        return all(done[g] or all(transport.arrived(key) for key in tables.incoming[g])
                   for g in plan.grad_recvs[head])

    def _ready_early(self, program: Program, plan: DeviationPoints, early: int) -> bool:
        """Whether forward `early` can run now (under the monitor's lock): its events are done but for
        its activations' receives, whose messages have arrived (the compute stream takes those receives
        over, posting them under torch.distributed to see), and its stash fits in the device's pool."""
        device, code, tables = program.device, program.instructions, self.state.tables[program.device]
        done, owner = self.state.step.done[device], self.state.step.owner[device]
        recvs = plan.act_recvs[early]
        if not all(done[j] for j in code[early].waits if j not in recvs) or not self._headroom(code[early].stage):
            return False
        ready = True
        for r in recvs:
            if done[r]:
                continue
            if owner.setdefault(r, Stream.COMPUTE) is not Stream.COMPUTE:
                return False  # the p2p_in thread is receiving it: it has not arrived
            ready = all([self.state.transport.poll(key, tables.labels[r]) for key in tables.incoming[r]]) and ready
        return ready

    def _headroom(self, stage: int) -> bool:
        """An early forward adds one stash: only where the pool has room for the stage's last one."""
        pool = self.state.workers[stage].pool
        if pool.capacity is None:
            return True
        need = self.state.stash_bytes.get(stage)
        return need is not None and pool.current + need <= pool.capacity

    def _note_stash(self, ins: Forward) -> None:
        held = self.state.workers[ins.stage].pool.held.get(("stash", ins.stage, ins.microbatch))
        if held is not None:
            self.state.stash_bytes[ins.stage] = held[1]

    def _run_early(self, program: Program, plan: DeviationPoints, early: int, head: int, run: RunInstruction) -> None:
        """Forward `early` ahead of `head`: its receives (messages already here), the forward, and its
        sends right away (they never block), which the p2p_out thread then skips."""
        done = self.state.step.done[program.device]
        for r in plan.act_recvs[early]:
            if not done[r]:
                run(program, r, Stream.COMPUTE)
        run(program, early, Stream.COMPUTE)
        self.state.step.deviations.append((program.device, early, head))
        for s in plan.act_sends[early]:
            if self.claim(program.device, s, Stream.COMPUTE):
                run(program, s, Stream.COMPUTE)
