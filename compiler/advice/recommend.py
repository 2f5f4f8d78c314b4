"""`sw.recommend`: which devices to rent, by simulation (Srifty §4, Gavel's throughput per dollar).

For each candidate device set (an instance type of the catalogue in counts of powers of two, or
the requests the user names) the planner runs as `sw.plan` does: every schedule, microbatch count
and swapping choice it would weigh, simulated on modelled costs. Each candidate then has a
predicted iteration time, per-device memory and, from the catalogue's hourly price, a cost per
step and for the run (`steps`). Candidates that break a constraint (memory, `deadline_s`,
`budget_usd`) are kept in the table with the reason; the rest are ranked by `objective`. When
none meets every constraint the answer says which constraint binds and by how much (Srifty's
UNSAT), from the candidates that meet the others.

Srifty's pruning (§4.4): instance counts are powers of two; the search is exhaustive, since a
catalogue's candidates number tens, not the thousands where Srifty anchors its search. One
capture of the model serves every candidate with the same first microbatch count.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch

from stagewise.catalogue.entries import Catalogue, InstanceType
from stagewise.catalogue.files import shipped_catalogue
from stagewise.compiler.advice.device_mix import Mix, check_request, mix_of
from stagewise.compiler.advice.recommend_report import (
    Candidate,
    Out,
    Recommendation,
    binding_constraint,
    rank,
)
from stagewise.compiler.assembly.options import CompileOptions, CompileRequest
from stagewise.compiler.compile.analysis import Analysis
from stagewise.compiler.compile.driver import make_options, planned
from stagewise.ir.choices import CostModel, Schedule
from stagewise.ir.devices import format_bytes
from stagewise.ir.errors import CapacityError, DeviceError, OptionError, PartitionError
from stagewise.ir.topology import Topology
from stagewise.passes.pipedream_dp import NoFeasiblePlan
from stagewise.passes.swap import SwapMode

Progress = Callable[[int, int, str], None]  # (candidates done, candidates in all, the one starting)
OBJECTIVES = ("cost", "time")


@dataclass(frozen=True)
class Constraints:
    """What a recommendation must meet: a deadline and a budget for `steps` steps."""

    objective: str
    steps: int
    deadline_s: float | None
    budget_usd: float | None


def recommend(
    model: torch.nn.Module,
    example_inputs,
    *,
    catalogue: Catalogue | None = None,
    candidates: Sequence[str] | None = None,
    objective: str = "cost",
    deadline_s: float | None = None,
    budget_usd: float | None = None,
    steps: int = 1,
    max_devices: int = 8,
    precision: str = "fp32",
    optimizer=None,
    loss_fn=None,
    example_target=None,
    progress: Progress | None = None,
) -> Recommendation:
    """Rank device sets for training `model` (it may be on the meta device) on batches like
    `example_inputs`: `candidates` as device requests ("8xH100", "2xp4d.24xlarge", a mix joined by
    "+": "1xp4d.24xlarge+2xg6.xlarge", placed by the planner's CP-SAT binding), else every
    priced instance type of `catalogue` (the shipped one by default) in 1, 2, 4, ... instances up to
    `max_devices` devices. `objective` "cost" ranks by the run's price, "time" by iteration time;
    `deadline_s` and `budget_usd` bound the run of `steps` steps. Each candidate is planned as
    `sw.plan` plans (analytic costs from the catalogue's figures), so nothing runs on the devices.

    Args:
        model: the model; it may be on the meta device.
        example_inputs: one minibatch, as compile takes it.
        catalogue: where device figures and prices come from; None for the shipped one.
        candidates: device requests to weigh; None for every priced instance type.
        objective: 'cost' or 'time'.
        deadline_s: the run's longest time, or None.
        budget_usd: the run's highest price, or None.
        steps: the run's training steps (for its time and price).
        max_devices: the most devices of a default candidate.
        precision: 'fp32', 'bf16' or 'fp16': the figures and the plan's precision.
        optimizer: as compile takes it (its state is charged to memory).
        loss_fn: as compile takes it.
        example_target: as compile takes it.
        progress: called with (done, total, request) before each candidate.

    Returns:
        The `Recommendation`: every candidate ranked, the best first if it meets the constraints.

    Raises:
        OptionError: an unknown objective, a bad deadline, budget or step count, candidates that
            are a string or empty, or no candidate at all.
        DeviceError: a candidate request that is misspelt or names nothing in the catalogue.

    Example:
        >>> recommendation = sw.recommend(model, (x,), loss_fn=F.cross_entropy, example_target=y,
        ...                               candidates=["1xg6.xlarge", "1xp4d.24xlarge"], steps=1000)
        >>> recommendation.best.request, [row.devices for row in recommendation.rows]
        ('1xg6.xlarge', [1, 8])
    """
    constraints = _constraints(objective, steps, deadline_s, budget_usd)
    catalogue = catalogue if catalogue is not None else shipped_catalogue()
    requests = _requests(candidates) if candidates is not None else default_requests(catalogue, max_devices)
    for request in requests:
        check_request(request, catalogue)
    if not requests:
        raise OptionError(f"no candidate device set: the catalogue has no priced instance type of at most "
                          f"{max_devices} devices; give candidates=['8xH100', ...] or raise max_devices")
    options = make_options(loss_fn=loss_fn, example_target=example_target, optimizer=optimizer, microbatches=None,
                           schedule=Schedule.AUTO, cost=CostModel.ANALYTIC, split_points=None, clip_grad_norm=None, swap=SwapMode.AUTO,
                           replicas=1, stages=None, optimizer_on_host=False, seed=0, precision=precision)
    rows, analysis = [], None
    for done, request in enumerate(requests):
        if progress is not None:
            progress(done, len(requests), request)
        try:
            mix = mix_of(request, catalogue, precision)
        except DeviceError as error:  # e.g. no tf32 figure for a T4: out, with the reason
            rows.append(Candidate(request, 0, 0, None).without_plan(Out.UNPLANNABLE, _first_clause(error)))
            continue
        row, analysis = _candidate(request, mix, model, example_inputs, options, analysis)
        rows.append(row.judged(constraints.steps, constraints.deadline_s, constraints.budget_usd))
    if progress is not None:
        progress(len(requests), len(requests), "")
    ranked = rank(rows, constraints.objective, constraints.steps)
    return Recommendation(ranked, constraints.objective, constraints.steps, constraints.deadline_s,
                          constraints.budget_usd, binding_constraint(ranked, constraints.steps,
                                                                     constraints.deadline_s, constraints.budget_usd))


def default_requests(catalogue: Catalogue, max_devices: int) -> list[str]:
    """Every instance type with an on-demand price, in 1, 2, 4, ... instances up to `max_devices`."""
    requests = []
    for name in catalogue.instance_type_names():
        instance = catalogue.instance_type(name)
        if instance.on_demand is None or not _has_figures(catalogue, instance):
            continue
        count = 1
        while count * instance.accelerators <= max_devices:
            requests.append(f"{count}x{instance.name}")
            count *= 2
    return requests


def _has_figures(catalogue: Catalogue, instance: InstanceType) -> bool:
    """Whether its accelerator has the memory and peak figures a plan needs (the A10G has no peak)."""
    accelerator = catalogue.accelerator_of(instance)
    return accelerator.memory is not None and bool(accelerator.peak_flops.dtypes())


def _requests(candidates: object) -> list[str]:
    """`candidates` as a list of device requests: a lone string would be read character by character,
    an empty list would rank nothing."""
    if isinstance(candidates, str):
        raise OptionError(f"candidates takes a list of device requests, got the string {candidates!r} alone (read "
                          f"as its characters): write candidates=[{candidates!r}]")
    if not isinstance(candidates, Sequence | set | frozenset):
        raise OptionError(f"candidates takes a list of device requests such as ['8xH100', '2xp4d.24xlarge'], got "
                          f"{type(candidates).__name__} {candidates!r}")
    if not candidates:
        raise OptionError("candidates=[] gives no device set to rank: give at least one request, such as "
                          "candidates=['8xH100'], or leave candidates out to rank the catalogue's instance types")
    return list(candidates)


def _constraints(objective: str, steps: int, deadline_s: float | None, budget_usd: float | None) -> Constraints:
    if objective not in OBJECTIVES:
        raise OptionError(f"objective={objective!r}; choose 'cost' (the run's price) or 'time' (iteration time)")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise OptionError(f"steps={steps!r} must be a positive int (the run the deadline and budget are for)")
    for name, value in (("deadline_s", deadline_s), ("budget_usd", budget_usd)):
        if value is not None and not (isinstance(value, int | float) and value > 0):
            raise OptionError(f"{name}={value!r} must be a positive number, or None for no limit")
    return Constraints(objective, steps, deadline_s, budget_usd)


def _candidate(request: str, mix: Mix, model: torch.nn.Module, example_inputs, options: CompileOptions,
               analysis: Analysis | None) -> tuple[Candidate, Analysis | None]:
    """One device set planned (or why it cannot be), and the capture to hand to the next."""
    row = Candidate(request, len(mix.devices), mix.instances, mix.usd_per_hour, figures=mix.figures,
                    note=mix.fallback)
    try:
        made = CompileRequest.make(model, mix.devices, example_inputs, _with_topology(options, mix.topology()),
                                   runs_here=False)
        plan, analysis = planned(made, analysis)
    except (CapacityError, NoFeasiblePlan) as error:  # nothing fits its devices' memory
        return row.without_plan(Out.MEMORY, _first_clause(error)), analysis
    except (DeviceError, PartitionError) as error:
        return row.without_plan(Out.UNPLANNABLE, _first_clause(error)), analysis
    return row.with_plan(plan, max(plan.predicted_peak_bytes, default=0), format_bytes), analysis


def _with_topology(options: CompileOptions, topology: Topology | None) -> CompileOptions:
    return replace(options, topology=topology)


def _first_clause(error: Exception) -> str:
    """The error's first clause, for a table cell: the rest (the fix) is for the raiser's message."""
    clause = _first_line(error).split("; ")[0]
    if clause.count("(") > clause.count(")"):  # the cut fell inside a parenthesis: drop it
        clause = clause[:clause.rindex(" (")] if " (" in clause else clause
    return clause if len(clause) <= 110 else clause[:109] + "…"


def _first_line(error: Exception) -> str:
    return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
