"""Choosing the plan: build candidate plans on the analysed graph, let the planner simulate them
and keep the simplest that fits within a margin of the fastest, agree on it across ranks, and rebuild it at its own size."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import NamedTuple

import torch

from stagewise.compiler.assembly.asynchronous import two_bw_candidates
from stagewise.compiler.assembly.layout_options import check_stage_count
from stagewise.compiler.assembly.options import CompileRequest
from stagewise.compiler.compile.analysis import Analysed, Analysis
from stagewise.compiler.compile.costing import Costs
from stagewise.compiler.compile.plan_warnings import warn_assumed_rates, warn_does_not_fit
from stagewise.ir.choices import ActivationPolicy, Schedule
from stagewise.ir.errors import (
    CapacityError,
    OptionError,
    PartitionError,
    StagewiseError,
)
from stagewise.ir.plan import LayerCost
from stagewise.passes.activations import PER_STAGE_SCHEDULES, Policies, Scored, choose_policies
from stagewise.passes.harmony_plan import HARMONY
from stagewise.passes.harmony_search import PackSearch, choose_with_harmony
from stagewise.passes.layout import Grouping, choose_layout, groupings
from stagewise.passes.partition import starts_from_split_points
from stagewise.passes.pipedream_dp import NoFeasiblePlan
from stagewise.passes.pipedream_partition import (
    check_replicated_schedule,
    consecutive_devices,
    replicated_partition,
)
from stagewise.passes.planner import (
    REPLICATING,
    Assembled,
    Candidate,
    Prediction,
    Verdict,
    assemble,
    candidates,
    keep_simplest,
    partition,
    predict,
    sim_cost,
    simplicity,
)
from stagewise.passes.simulate import SimCost
from stagewise.passes.swap import SwapMode
from stagewise.passes.zero_bubble_plans import finalists, weighs_split_backward, zero_bubble_candidates


class Built(NamedTuple):
    """One candidate built: the plan, its layers' costs and its microbatch size (unpacked so by
    the planner's `choose`)."""

    plan: Assembled
    layer_costs: list[LayerCost]
    microbatch_size: int


@dataclass(frozen=True)
class Placement:
    """Stage starts and each stage's device, decided elsewhere (the planner, or rank 0); with
    replicated stages, each stage's replicas' devices; each stage's activation policy."""

    starts: tuple[int, ...]
    stage_devices: tuple[int, ...]
    replica_devices: tuple[tuple[int, ...], ...] = ()
    activations: tuple[tuple[int, ActivationPolicy], ...] = ()  # per stage instance, its policy (): choose


@dataclass(frozen=True)
class Choice:
    """The plan compile keeps, built at its own microbatch size, and what the planner predicted."""

    plan: Assembled
    prediction: Prediction
    considered: tuple[str, ...]  # every candidate tried, one line each (empty when none was searched)
    sim_cost: SimCost  # the plan's per-stage costs, which `Pipeline.simulate` replays


@dataclass
class PlanBuilder:
    """Builds candidate plans for one compile; candidates that partition alike share the partition
    and the stages built from it."""

    request: CompileRequest
    analysis: Analysis
    costs: Costs
    partitions: dict[tuple, tuple[list[int], list[int]]] = field(default_factory=dict)
    built: dict[tuple, tuple] = field(default_factory=dict)  # stages per partition, for `assemble`
    replicated: dict[tuple, tuple[list[int], tuple[tuple[int, ...], ...]]] = field(default_factory=dict)

    def build(self, candidate: Candidate, placement: Placement | None = None, exact: bool = False) -> Built:
        """`candidate` on the first graph (layers and per-sample bytes do not depend on the
        microbatch size), or `exact`ly on the graph at its own size (what the runtime needs)."""
        request, options = self.request, self.request.options
        name, m = candidate.schedule, candidate.microbatches
        graph = self.analysis.at(m) if exact else self.analysis.first
        size = request.batch // m
        layout = choose_layout(name, len(request.devices), candidate.replicas, graph.legal_cuts, candidate.stages,
                               candidate.grouping)
        layer_costs = self.costs.layers.at(size)
        replica_devices: tuple[tuple[int, ...], ...] = ()
        if candidate.replicates_stages:
            starts, replica_devices = ((list(placement.starts), placement.replica_devices) if placement
                                       else self._replicated(candidate, graph, size))
            stage_devices = [on[0] for on in replica_devices]
        elif placement is not None:
            starts, stage_devices = list(placement.starts), list(placement.stage_devices)
        elif options.split_points is not None:
            starts = starts_from_split_points(graph.layers, graph.cuts, list(options.split_points))
            if name not in HARMONY and len(starts) != layout.positions:  # Harmony's packs may be any number
                raise PartitionError(
                    f"split_points gives {len(starts)} stages but {len(request.devices)} devices with schedule '{name}' "
                    f"need {layout.positions}; give {layout.positions - 1} split points, or stages={len(starts)}"
                )
            stage_devices = [layout.device_of(s, 0) for s in range(len(starts))]
        elif name in HARMONY:  # the packs Alg. 1 chooses at this one size
            plan, packed_costs, size = self.pack_search(graph, exact).build(candidate)
            return Built(plan, list(packed_costs), size)
        else:
            # the straight pipelines (gpipe, 1f1b, varuna) at one size share a partition
            key = ("pipeline" if name in REPLICATING else name, size, layout.positions, layout.replicas, layout.grouping)
            if key not in self.partitions:
                self.partitions[key] = partition(name, graph.layers, graph.cuts, layer_costs, layout, request.specs, size,
                                                 self.costs.topology)
            starts, stage_devices = self.partitions[key]
        assembled = functools.partial(
            assemble, graph.graph, graph.layers, graph.cuts, graph.microbatch_size, name, m, starts, stage_devices, layout,
            options.swap, request.capacities, options.reduces_grad_norm, self.costs.state_ratio,
            optimizer_on_host=options.optimizer_on_host, stash_bytes=[c.stash_bytes for c in layer_costs],
            built=self.built, replica_devices=replica_devices, grad_bytes=[c.grad_bytes for c in layer_costs],
            host_optimizer_bytes=self.costs.host_optimizer_ratio)
        return Built(self._with_activations(name, assembled, layer_costs, size, placement), layer_costs, size)

    def _with_activations(self, name: Schedule, assembled: Callable[..., Assembled], layer_costs: list[LayerCost],
                          size: int, placement: Placement | None) -> Assembled:
        """The candidate with each stage's activation policy: the one asked for, rank 0's (`placement`),
        or chosen per stage by simulating each (passes/activations.py; Harmony's packs one policy for all).
        Varuna keeps its own."""
        request, asked = self.request, self.request.options.activations
        if name not in PER_STAGE_SCHEDULES:
            if asked is not ActivationPolicy.AUTO:
                raise OptionError(f"activations='{asked}' is not for the {name} schedule, which recomputes or swaps "
                                  f"by its own rules; use it with {', '.join(PER_STAGE_SCHEDULES)}, or activations='auto'")
            return assembled()
        if placement is not None and placement.activations:
            return assembled(activations=dict(placement.activations))
        plan = assembled(activations=asked)
        if asked is not ActivationPolicy.AUTO or request.options.swap is SwapMode.ALL:
            return plan

        def scored(candidate: Assembled) -> Scored:
            prediction, _ = predict(candidate, layer_costs, request.specs, size, self.costs.topology, self.costs.runtime)
            return Scored(candidate, prediction.iteration_s, prediction.peak_bytes,
                          tuple(spec.memory for spec in request.specs))

        def build(policies: Policies) -> Scored:
            return scored(assembled(activations=policies))

        return choose_policies(scored(plan), build, swap_allowed=request.options.swap is not SwapMode.OFF,
                               per_stage=name not in HARMONY).plan

    def pack_search(self, graph: Analysed, exact: bool) -> PackSearch:
        """Harmony's Alg. 1 over `graph`, building its configurations as `build` does."""
        request = self.request

        def build_packs(candidate: Candidate, starts: tuple[int, ...], on: tuple[int, ...]) -> Built:
            return self.build(candidate, Placement(starts, on), exact)

        return PackSearch(build_packs, request.batch, len(graph.layers), graph.cuts, self.costs.layers.at,
                          request.specs, self.costs.topology, self.costs.runtime)

    def _replicated(self, candidate: Candidate, graph, size: int) -> tuple[list[int], tuple[tuple[int, ...], ...]]:
        """Stage starts and each stage's replicas' devices (PipeDream's replicated stages): from the
        split points with the replication given, or from the DP (gpipe and 1f1b share them)."""
        request, split_points = self.request, self.request.options.split_points
        check_replicated_schedule(candidate.schedule)
        key = (size, candidate.stage_replicas)  # () when the DP chooses
        if key not in self.replicated and split_points is not None:
            starts = starts_from_split_points(graph.layers, graph.cuts, list(split_points))
            check_stage_count(len(starts), candidate.stage_replicas)
            self.replicated[key] = (starts, consecutive_devices(candidate.stage_replicas, len(request.devices)))
        elif key not in self.replicated:
            found = replicated_partition(candidate.schedule, graph.layers, graph.cuts, self.costs.layers.at(size),
                                         request.specs, size, self.costs.topology, candidate.stage_replicas)
            self.replicated[key] = (list(found.starts), found.devices)
        return self.replicated[key]


def choose_plan(request: CompileRequest, analysis: Analysis, costs: Costs) -> Choice:
    """The one plan asked for, or the fastest candidate that fits; the same on every rank, and
    built at its own microbatch size."""
    if not request.runs_here:
        warn_assumed_rates(request)
    builder = PlanBuilder(request, analysis, costs)
    options = request.options
    if options.searched:
        found, prediction, considered = _search(request, builder, analysis, costs)
    else:
        found, prediction, considered = _asked(request, builder, costs)
    chosen = _exactly(_agree_across_ranks(found, builder), builder, analysis)
    size = request.batch // chosen.microbatches
    cost = sim_cost(chosen, costs.layers.at(size), request.specs, size, costs.topology, costs.runtime)
    return Choice(chosen, prediction, considered, cost)


def _asked(request: CompileRequest, builder: PlanBuilder, costs: Costs) -> tuple[Assembled, Prediction, tuple[str, ...]]:
    """The one plan the options ask for. Where its P x D instances may be grouped on the hosts two
    ways (passes/layout.py `groupings`) both are built and simulated, and the planner's rule keeps one
    (the simplest that fits within its margin of the fastest), both listed as considered."""
    options = request.options
    name = Schedule.GPIPE if options.schedule == Schedule.AUTO else options.schedule
    replicas = options.replicas if isinstance(options.replicas, int) else 1
    depth = options.stages if isinstance(options.stages, int) else None
    per_stage = options.replicas if isinstance(options.replicas, tuple) else ()
    asked = Candidate(name, request.first_microbatches, replicas, depth, stage_replicas=per_stage)
    ways = groupings(name, replicas, depth or len(request.devices) // replicas, _hosts(builder)) if not per_stage \
        else [Grouping.PIPELINES]
    tried = []
    for grouping in ways:
        option = replace(asked, grouping=grouping)
        built = builder.build(option, exact=True)
        prediction, _ = predict(built.plan, built.layer_costs, request.specs, built.microbatch_size, costs.topology,
                                costs.runtime)
        tried.append((option, built.plan, prediction))
    scored = [(simplicity(plan), prediction) for _, plan, prediction in tried]
    kept = keep_simplest(scored)[0] if any(prediction.fits for _, prediction in scored) else 0
    _, found, prediction = tried[kept]
    if not prediction.fits:
        warn_does_not_fit(prediction, request)
    return found, prediction, tuple(_describe(option, result) for option, _, result in tried) if len(tried) > 1 else ()


def _hosts(builder: PlanBuilder) -> tuple[int, ...]:
    """The host of each device, from the links measured or given (one host for in-process devices)."""
    topology = builder.costs.topology
    return tuple(topology.host_of(d) for d in range(topology.n_devices))


def _search(request: CompileRequest, builder: PlanBuilder, analysis: Analysis,
            costs: Costs) -> tuple[Assembled, Prediction, tuple[str, ...]]:
    """Simulate every candidate the options allow; the simplest that fits within the planner's margin
    of the fastest (passes/planner.py `keep_simplest`), its prediction, and a line per candidate
    tried, the chosen one and the fastest marked so, with why. Where the training state fits but no
    candidate does, Harmony's packs are tried before the plan is refused."""
    needs_swap = _needs_swap(request, analysis, costs)
    refused: tuple[str, ...] = ()
    try:
        chosen, prediction, tried, verdict = _choose_among(request, builder, analysis, needs_swap)
    except (CapacityError, NoFeasiblePlan) as error:
        if needs_swap or request.options.schedule != Schedule.AUTO or request.options.swap != SwapMode.AUTO:
            raise
        # the state fits but no straight pipeline's activations do (one stage of a single device holds
        # the whole model's): Harmony's packs, swapping only what does not fit (issue 23's 1.3 B GPT
        # with the optimizer on the host was refused here)
        refused = (f"straight pipelines (gpipe, 1f1b, interleaved): none fits: {str(error).splitlines()[0]}",)
        chosen, prediction, tried, verdict = _choose_among(request, builder, analysis, needs_swap=True)
    notes = verdict.notes(tried)
    return chosen, prediction, refused + tuple(_describe(option, result) + notes.get(row, "")
                                               for row, (option, result) in enumerate(tried))


def _choose_among(request: CompileRequest, builder: PlanBuilder, analysis: Analysis,
                  needs_swap: bool) -> tuple[Assembled, Prediction, list, Verdict]:
    """The planner's choice among the candidates the options allow (Harmony's where `needs_swap`); with
    schedule="auto", then among the zero-bubble candidates derived from the best of them and those
    within the margin of the fastest, built once (passes/zero_bubble_plans.py); one table of all."""
    options = request.options
    options_to_try = candidates(options.schedule, options.microbatches, request.batch, len(request.devices),
                                analysis.first.legal_cuts, needs_swap, options.replicas, options.stages,
                                _stages_at_full_speed(request), _hosts(builder))
    if options.asynchronous and options.schedule == Schedule.AUTO:
        options_to_try += two_bw_candidates(options_to_try)
    if options.microbatch_sizes is not None:
        fewest, most = options.microbatch_sizes
        options_to_try = [c for c in options_to_try if fewest <= request.batch // c.microbatches <= most]
    search = builder.pack_search(analysis.first, exact=False)
    whole_backward = options.acceleration.compile_stages or options.acceleration.cuda_graphs
    if options.schedule != Schedule.AUTO or needs_swap or not weighs_split_backward(whole_backward):
        return choose_with_harmony(options_to_try, builder.build, search)
    build = _built_once(builder.build)
    first = choose_with_harmony(options_to_try, build, search)
    v_allowed = request.distributed is None or torch.distributed.get_backend() == "gloo"  # runtime/links.py
    derived = zero_bubble_candidates(first[2], len(request.devices), analysis.first.legal_cuts, v_allowed)
    if not derived:
        return first
    plan, prediction, rows, verdict = choose_with_harmony(finalists(first[2]) + derived, build, search)
    return plan, prediction, first[2] + [row for row in rows if row[0] in derived], verdict


def _built_once(build: Callable[[Candidate], Built]) -> Callable[[Candidate], Built]:
    """`build`, each candidate built (or refused) once."""
    done: dict[Candidate, Built | StagewiseError] = {}

    def once(candidate: Candidate) -> Built:
        if candidate not in done:
            try:
                done[candidate] = build(candidate)
            except StagewiseError as error:
                done[candidate] = error
        found = done[candidate]
        if isinstance(found, StagewiseError):
            raise found
        return found
    return once


def _stages_at_full_speed(request: CompileRequest) -> int | None:
    """The deepest pipeline stages="auto" tries on in-process CPU devices: one stage per core that
    computes at full speed. More compute threads than cores only time-slice, and a stage preempted
    mid-compute holds up the whole pipeline, which processor sharing in the simulator does not
    see (3 stages on this 2-core machine measured 5-18% slower than predicted, 2 stages 1-9%)."""
    if request.distributed is not None or any(d.torch_device.type != "cpu" for d in request.devices):
        return None
    return max(1, int(request.cores_at_full_speed))


def _needs_swap(request: CompileRequest, analysis: Analysis, costs: Costs) -> bool:
    """Whether the devices' memory cannot hold the training state without swapping (with margin)."""
    swap = request.options.swap
    if swap in (SwapMode.ON, SwapMode.ALL, SwapMode.PER_DEVICE):
        return True
    if swap == SwapMode.OFF or all(c is None for c in request.capacities):
        return False
    layers = costs.layers.at(analysis.first.microbatch_size)
    # gradients and optimizer state only for trainable parameters (a frozen one has neither)
    state = analysis.first.param_bytes + (costs.state_ratio - 1) * sum(c.grad_bytes for c in layers)
    return state > sum(c for c in request.capacities if c) * 0.75


def _describe(candidate: Candidate, result: Prediction | str) -> str:
    what = candidate.describe()
    if isinstance(result, str):
        return f"{what} not possible: {result}"
    fits = "fits" if result.fits else "does not fit" + (" host memory" if result.hosts_over else "")
    return f"{what} {result.iteration_s * 1e3:9.2f} ms/iteration, {fits}"


def _exactly(chosen: Assembled, builder: PlanBuilder, analysis: Analysis) -> Assembled:
    """The chosen plan rebuilt on the graph at its own microbatch size (transfer shapes, the sizes in
    export graphs' stage code); the same capture, evaluated at that size (no new trace, but where
    the model could not keep its batch symbolic)."""
    if chosen.microbatches == analysis.first_microbatches:
        return chosen
    if len(analysis.at(chosen.microbatches).layers) != len(analysis.first.layers):
        return builder.build(_candidate_of(chosen), exact=True).plan  # the graph changed with the size: plan again
    return builder.build(_candidate_of(chosen), _placement_of(chosen), exact=True).plan


def _candidate_of(plan: Assembled) -> Candidate:
    if plan.replica_devices:
        return Candidate(plan.schedule, plan.microbatches, stage_replicas=plan.stage_replicas)
    stages = plan.layout.positions if plan.schedule in REPLICATING else None
    return Candidate(plan.schedule, plan.microbatches, plan.layout.replicas, stages, grouping=plan.layout.grouping)


def _placement_of(plan: Assembled) -> Placement:
    return Placement(tuple(plan.starts), tuple(plan.stage_devices), plan.replica_devices,
                     tuple((s.index, s.activations) for s in plan.stages))


def _agree_across_ranks(chosen: Assembled, builder: PlanBuilder) -> Assembled:
    """Under torch.distributed every rank must run the same plan: rank 0's choice wins (this rank's
    measurements may have led elsewhere: then it builds rank 0's plan here)."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return chosen
    mine = (_candidate_of(chosen), _placement_of(chosen))
    decision = [mine]
    torch.distributed.broadcast_object_list(decision, src=0)
    if decision[0] == mine:
        return chosen
    candidate, placement = decision[0]
    return builder.build(candidate, placement, exact=True).plan
