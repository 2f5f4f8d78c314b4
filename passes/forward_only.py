"""The forward-only programs of a plan, for evaluation and inference: each device runs the forwards
of its training program, in the same order, without stash, backward, update, all-reduce or swap.

The order is the training program's with everything but the forwards left out: the training
programs run without deadlock and a forward waits only for forwards, so the kept order does too,
and no compute stream waits for a backward that never comes (no bubbles of backward).
"""

from __future__ import annotations

from stagewise.ir.instructions import Forward, Phase
from stagewise.ir.plan import Plan, Task
from stagewise.ir.program import Program
from stagewise.passes.lower import lower


def forward_tasks(programs: tuple[Program, ...]) -> list[list[Task]]:
    """Per device, a forward task without stash for each forward of its training program, in order."""
    return [[Task(Phase.FORWARD, ins.stage, ins.microbatch, stash=False)
             for ins in program.instructions if isinstance(ins, Forward)]
            for program in programs]


def forward_only_programs(plan: Plan) -> tuple[Program, ...]:
    """The plan's programs lowered with forward tasks only (validated, as every lowering is)."""
    return lower(plan.stages, plan.transfers, (), forward_tasks(plan.programs), clip_grad_norm=False)
