"""Schedules: the order in which each stage runs its forward, backward and update tasks.

GPipe (Huang et al., as used by Harmony and Varuna as the baseline): every microbatch's
forward, then every backward in reverse order, then one synchronous update. Gradients are
accumulated over microbatches, so the step equals one step on the whole minibatch.
"""

from __future__ import annotations

from stagewise.compiler.errors import PlanError
from stagewise.compiler.ir import Task

SCHEDULES = ("auto", "gpipe", "1f1b", "interleaved", "varuna", "harmony-pp", "harmony-dp")


def gpipe(n_stages: int, microbatches: int) -> list[list[Task]]:
    return [
        [Task("F", s, mb) for mb in range(microbatches)]
        + [Task("B", s, mb) for mb in reversed(range(microbatches))]
        + [Task("U", s)]
        for s in range(n_stages)
    ]


def schedule_tasks(name: str, n_stages: int, microbatches: int) -> tuple[str, list[list[Task]]]:
    """The resolved schedule name and each stage's task list."""
    if name not in SCHEDULES:
        raise PlanError(f"unknown schedule {name!r}; choose one of {', '.join(SCHEDULES)}")
    if name in ("auto", "gpipe"):
        return "gpipe", gpipe(n_stages, microbatches)
    raise PlanError(f"schedule {name!r} is not implemented yet; use schedule='gpipe' (or 'auto')")
