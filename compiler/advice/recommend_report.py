"""What `sw.recommend` returns: one row per candidate device set, ranked, and why none fits.

A row keeps a candidate that breaks a constraint, with the reason, so the table shows what the
constraint costs (Srifty's table of configurations). `binding_constraint` is Srifty's UNSAT
answer: when no row meets every constraint, the one that binds and by how much, read off the
rows that meet the others.
"""

from __future__ import annotations

import enum
import io
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from rich.console import Console
from rich.table import Table

from stagewise.ir.plan import Plan

SECONDS_PER_HOUR = 3600.0
SPLIT_COLUMN = "% compute/bubble/\nswap/p2p/all-reduce"  # the predicted split's shares (ir/time_split.py)


class Out(enum.Enum):
    """Why a candidate is out."""

    MEMORY = "memory"  # no plan fits its devices' memory
    UNPLANNABLE = "unplannable"  # no figure for the precision, too few cut-points, ...
    DEADLINE = "deadline"
    BUDGET = "budget"


@dataclass(frozen=True)
class Candidate:
    """One device set `sw.recommend` weighed: its plan's prediction, its price, and why it is out
    (empty when it is in); a row of the `Recommendation`.

    Args:
        request: the device set as `parse_device_request` reads it, '2xp4d.24xlarge'.
        devices: how many devices it holds.
        instances: how many instances.
        usd_per_hour: every instance of the set together; None where the catalogue has no price.
        plan: the plan made for it; None where none fits or could be made.
        iteration_s: the plan's predicted seconds per step.
        peak_memory: the busiest device's predicted peak, formatted.
        why_not: why it is out, for the table.
        out: which constraint rules it out; None when it meets them all.
        figures: 'measured' or 'datasheet', where its figures come from.
        note: what the row's prediction assumes beyond the figures ('bf16 timed at the fp16
            rate: T4-16GB has no bf16 units'), shown beside the reason it is out.

    Example:
        >>> row = recommendation.best  # sw.recommend(model, (x,), ..., candidates=["1xg6.xlarge", "1xp4d.24xlarge"])
        >>> row.request, row.devices, row.usd_per_hour
        ('1xg6.xlarge', 1, 0.8048)
    """

    request: str  # as parse_device_request reads it: "2xp4d.24xlarge"
    devices: int
    instances: int
    usd_per_hour: float | None  # every instance of the set together; None: not priced
    plan: Plan | None = None
    iteration_s: float | None = None
    peak_memory: str = ""  # the busiest device's predicted peak, formatted
    why_not: str = ""  # the reason, for the table
    out: Out | None = None
    figures: str = ""  # "measured" (sw.probe_accelerator, or the user's own) or "datasheet"
    note: str = ""  # what the prediction assumes beyond the figures (a precision timed at another's rate)

    def with_plan(self, plan: Plan, peak_bytes: int, formatted: Callable[[float], str]) -> Candidate:
        """The row once planned (what `sw.recommend` does with each device set that fits).

        Args:
            plan: the plan made for the device set.
            peak_bytes: the busiest device's predicted peak.
            formatted: how to write bytes for the table.

        Returns:
            A copy with the plan, its iteration time and peak memory.

        Example:
            >>> row = recommendation.best
            >>> row.with_plan(row.plan, 2048, lambda n: f"{n:.0f} B").peak_memory
            '2048 B'
        """
        return replace(self, plan=plan, iteration_s=plan.predicted_iteration_s, peak_memory=formatted(peak_bytes))

    def without_plan(self, out: Out, why: str) -> Candidate:
        """The row of a device set no plan fits or could be made for.

        Args:
            out: why it is out (`Out.MEMORY` or `Out.UNPLANNABLE`).
            why: the reason, for the table.

        Returns:
            A copy that is out, with the reason.

        Example:
            >>> from stagewise.compiler.advice.recommend_report import Out
            >>> recommendation.best.without_plan(Out.MEMORY, "needs 3 GiB").why_not
            'memory: needs 3 GiB'
        """
        return replace(self, out=out, why_not=f"{out.value}: {why}" if out is Out.MEMORY else why)

    def run_s(self, steps: int) -> float | None:
        """The predicted time of a run.

        Args:
            steps: the run's training steps.

        Returns:
            Seconds for `steps` steps; None where no plan fits.

        Example:
            >>> row = recommendation.best
            >>> row.run_s(1000) == row.iteration_s * 1000
            True
        """
        return None if self.iteration_s is None else self.iteration_s * steps

    def run_usd(self, steps: int) -> float | None:
        """The predicted price of a run.

        Args:
            steps: the run's training steps.

        Returns:
            Dollars for `steps` steps at `usd_per_hour`; None where no plan fits or no price is known.

        Example:
            >>> row = recommendation.best
            >>> import math
            >>> math.isclose(row.run_usd(3600), row.usd_per_hour * row.iteration_s)  # an hour's steps
            True
        """
        if self.iteration_s is None or self.usd_per_hour is None:
            return None
        return self.usd_per_hour * self.iteration_s * steps / SECONDS_PER_HOUR

    @property
    def fits(self) -> bool:
        """Whether a plan fits the device set's memory.

        Example:
            >>> recommendation.best.fits
            True
        """
        return self.plan is not None

    @property
    def meets(self) -> bool:
        """Whether the row meets every constraint (memory, deadline, budget).

        Example:
            >>> recommendation.best.meets
            True
        """
        return self.out is None

    def judged(self, steps: int, deadline_s: float | None, budget_usd: float | None) -> Candidate:
        """The row judged against a run's constraints.

        Args:
            steps: the run's training steps.
            deadline_s: the run's longest time, or None.
            budget_usd: the run's highest price, or None.

        Returns:
            The row with the first constraint it breaks named (memory was named when it was
            planned); itself when it meets them all.

        Example:
            >>> late = recommendation.best.judged(1000, deadline_s=1e-9, budget_usd=None)
            >>> late.meets, late.why_not.split(":")[0]
            (False, 'deadline')
        """
        if not self.fits:
            return self
        run_s, run_usd = self.run_s(steps), self.run_usd(steps)
        if deadline_s is not None and run_s is not None and run_s > deadline_s:
            return replace(self, out=Out.DEADLINE, why_not=f"deadline: {_duration(run_s)} > {_duration(deadline_s)}")
        if budget_usd is not None and run_usd is None:
            return replace(self, out=Out.BUDGET, why_not="budget: no price in the catalogue")
        if budget_usd is not None and run_usd is not None and run_usd > budget_usd:
            return replace(self, out=Out.BUDGET, why_not=f"budget: ${run_usd:,.2f} > ${budget_usd:,.2f}")
        return self


@dataclass(frozen=True)
class Recommendation:
    """What `sw.recommend` found: the candidates, those meeting every constraint first in the
    objective's order; `print` it for the table and the verdict.

    Args:
        rows: the candidates, ranked.
        objective: 'cost' (by the run's price) or 'time' (by iteration time).
        steps: the run's training steps.
        deadline_s: the run's longest time, or None.
        budget_usd: the run's highest price, or None.
        unsatisfied: empty when some row meets every constraint; else the binding one, by how much.

    Example:
        >>> recommendation = sw.recommend(model, (x,), loss_fn=F.cross_entropy, example_target=y,
        ...                               candidates=["1xg6.xlarge"], deadline_s=1e-6)
        >>> recommendation.best is None, recommendation.unsatisfied.split(":")[0]
        (True, 'deadline')
    """

    rows: tuple[Candidate, ...]
    objective: str
    steps: int
    deadline_s: float | None
    budget_usd: float | None
    unsatisfied: str  # empty when some row meets every constraint; else the binding one, by how much

    @property
    def best(self) -> Candidate | None:
        """The first row if it meets every constraint; None when none does (`unsatisfied` says why).

        Example:
            >>> recommendation.best.request
            '1xg6.xlarge'
        """
        return self.rows[0] if self.rows and self.rows[0].meets else None

    def __str__(self) -> str:
        table = Table(title=f"devices for {self.steps} steps, by {self.objective}" + _limits(self))
        for column in ("#", "devices", "n", "iteration", "$/hour", "$/step", "run", "run $", "peak memory",
                       "plan", SPLIT_COLUMN, "bound", "figures", "out because / note"):
            table.add_column(column, justify="left" if column in ("devices", "plan", "out because / note") else "right")
        for index, row in enumerate(self.rows, 1):
            split = row.plan.predicted_split if row.plan is not None else None
            table.add_row(str(index) if row.meets else "-", row.request, str(row.devices), _ms(row.iteration_s),
                          _usd(row.usd_per_hour), _usd(row.run_usd(1), 4), _duration(row.run_s(self.steps)),
                          _usd(row.run_usd(self.steps)), row.peak_memory, _plan(row.plan),
                          "" if split is None else split.percentages(), "" if split is None else str(split.bound),
                          row.figures, "; ".join(part for part in (row.why_not, row.note) if part))
        buffer = io.StringIO()
        Console(file=buffer, width=200, force_terminal=False, color_system=None).print(table)
        verdict = f"no candidate meets every constraint: {self.unsatisfied}" if self.unsatisfied else \
            f"recommended: {self.rows[0].request}"
        return buffer.getvalue() + verdict + "\n"


def rank(rows: Sequence[Candidate], objective: str, steps: int) -> tuple[Candidate, ...]:
    """Rows meeting every constraint first, by the run's price ("cost"; unpriced last) or iteration
    time ("time"); then the planned rows that break a constraint, then those that do not fit."""
    def key(row: Candidate) -> tuple:
        usd = row.run_usd(steps)
        time_s = row.iteration_s if row.iteration_s is not None else float("inf")
        order = (usd if usd is not None else float("inf"), time_s) if objective == "cost" else \
            (time_s, usd if usd is not None else float("inf"))
        return (not row.meets, not row.fits, *order, row.request)
    return tuple(sorted(rows, key=key))


def binding_constraint(rows: Sequence[Candidate], steps: int, deadline_s: float | None,
                       budget_usd: float | None) -> str:
    """Empty when a row meets every constraint; else which one binds and by how much."""
    if any(row.meets for row in rows):
        return ""
    planned = [row for row in rows if row.fits]
    if not planned:
        reasons = "; ".join(f"{row.request}: {row.why_not}" for row in rows[:3])
        if all(row.out is Out.MEMORY for row in rows):
            return f"memory: no candidate holds the model and its training state ({reasons})"
        return f"no candidate could be planned ({reasons})"
    fastest = min(planned, key=lambda row: row.run_s(steps) or float("inf"))
    priced = [row for row in planned if row.run_usd(steps) is not None]
    cheapest = min(priced, key=lambda row: row.run_usd(steps) or 0.0) if priced else None
    fastest_s = fastest.run_s(steps) or 0.0
    if deadline_s is not None and fastest_s > deadline_s:
        return (f"deadline: the fastest candidate, {fastest.request}, needs {_duration(fastest_s)} for "
                f"{steps} steps, {_duration(fastest_s - deadline_s)} ({fastest_s / deadline_s - 1:.0%}) over "
                f"{_duration(deadline_s)}")
    if cheapest is None:
        return "budget: no candidate has a price in the catalogue"
    cheapest_usd = cheapest.run_usd(steps) or 0.0
    if budget_usd is not None and cheapest_usd > budget_usd:
        return (f"budget: the cheapest candidate, {cheapest.request}, costs ${cheapest_usd:,.2f} for {steps} steps, "
                f"${cheapest_usd - budget_usd:,.2f} ({cheapest_usd / budget_usd - 1:.0%}) over ${budget_usd:,.2f}")
    return (f"deadline and budget together: each alone is met ({fastest.request} in {_duration(fastest_s)}, "
            f"{cheapest.request} for ${cheapest_usd:,.2f}), no candidate meets both")


def _limits(recommendation: Recommendation) -> str:
    parts = []
    if recommendation.deadline_s is not None:
        parts.append(f"deadline {_duration(recommendation.deadline_s)}")
    if recommendation.budget_usd is not None:
        parts.append(f"budget ${recommendation.budget_usd:,.2f}")
    return f" ({', '.join(parts)})" if parts else ""


def _plan(plan: Plan | None) -> str:
    if plan is None:
        return ""
    depth = len({stage.position for stage in plan.stages})
    replicas = len(plan.stages) // max(depth, 1)
    return f"{plan.schedule} P={depth}" + (f" D={replicas}" if replicas > 1 else "") + f" x{plan.microbatches}"


def _ms(seconds: float | None) -> str:
    return "" if seconds is None else f"{seconds * 1e3:.1f} ms"


def _usd(value: float | None, digits: int = 2) -> str:
    return "" if value is None else f"${value:,.{digits}f}"


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return ""
    if seconds < 120:
        return f"{seconds:.1f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"
