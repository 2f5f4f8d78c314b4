"""Schedules: the order in which each stage runs its forward, backward and update tasks.

GPipe (Huang et al., as used by Harmony and Varuna as the baseline): every microbatch's
forward, then every backward in reverse order, then one synchronous update. Gradients are
accumulated over microbatches, so the step equals one step on the whole minibatch.

1F1B (PipeDream-Flush, Narayanan's dissertation §4.2.2, Fig. 4.4 top): the same flush and
the same bubble, (p - 1)/m, but each stage alternates one forward with one backward after a
short warm-up, so at most p microbatches have activations stashed instead of m.
"""

from __future__ import annotations

from stagewise.compiler.errors import PlanError
from stagewise.compiler.ir import Task

SCHEDULES = ("auto", "gpipe", "1f1b", "interleaved", "varuna", "harmony-pp", "harmony-dp")


def gpipe(n_stages: int, microbatches: int) -> list[list[Task]]:
    """All forwards, then all backwards in reverse order, then the update (GPipe; §4.2.2 Fig. 4.3)."""
    return [
        [Task("F", s, mb) for mb in range(microbatches)]
        + [Task("B", s, mb) for mb in reversed(range(microbatches))]
        + [Task("U", s)]
        for s in range(n_stages)
    ]


def one_f_one_b(n_stages: int, microbatches: int) -> list[list[Task]]:
    """PipeDream-Flush: stage s warms up with min(p - s - 1, m) forwards, then runs 1F1B, then cools down.

    The warm-up fills the pipeline so that stage s's k-th backward meets the gradient that
    the later stages produced meanwhile; backwards run in microbatch order (§4.2.2).
    """
    tasks = []
    for s in range(n_stages):
        warmup = min(n_stages - s - 1, microbatches)
        order = [Task("F", s, mb) for mb in range(warmup)]
        for i in range(microbatches - warmup):
            order += [Task("F", s, warmup + i), Task("B", s, i)]
        order += [Task("B", s, mb) for mb in range(microbatches - warmup, microbatches)]
        tasks.append(order + [Task("U", s)])
    return tasks


def schedule_tasks(name: str, n_stages: int, microbatches: int) -> tuple[str, list[list[Task]]]:
    """The resolved schedule name and each stage's task list."""
    if name not in SCHEDULES:
        raise PlanError(f"unknown schedule {name!r}; choose one of {', '.join(SCHEDULES)}")
    if name in ("auto", "gpipe"):
        return "gpipe", gpipe(n_stages, microbatches)
    if name == "1f1b":
        return "1f1b", one_f_one_b(n_stages, microbatches)
    raise PlanError(f"schedule {name!r} is not implemented yet; use schedule='gpipe', '1f1b' or 'auto'")
