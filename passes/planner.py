"""The planner: partition, assemble and simulate candidate plans; keep the simplest that fits within a margin of the fastest.

For each candidate (schedule x microbatch count) it partitions the layers from their costs at
that microbatch size: PipeDream's dynamic program (§2.4.1) over contiguous layers for equal
devices, OR-Tools CP-SAT partition-and-binding when devices differ in speed or memory (Harmony's
packs and microbatch size come from its Alg. 1 and 2: passes/harmony_search.py); the DP and
CP-SAT read the links between the devices from their `Topology` (ir/topology.py: measured by compile). With replicas="per-stage"
the DP may also replicate single stages (a 2-1 plan), a candidate beside the straight pipeline
(passes/pipedream_partition.py). It then lowers the candidate to the same instruction programs the runtime
executes and simulates them (Srifty §3.3: an event-driven simulator over per-layer costs and the same links).
Of the candidates whose peak memory per device (messages arriving as early as they can: passes/early_arrivals.py)
fits every device (Harmony §4.3, Varuna §4.4) it keeps the lowest predicted iteration time, unless a simpler
one (`Simplicity`) is predicted within PLAN_MARGIN of it: then that, so that noise does not change the plan.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import NamedTuple

import torch.fx as fx

from stagewise.ir.choices import ActivationPolicy, Schedule
from stagewise.ir.costs import NO_RUNTIME_COSTS, RuntimeCosts
from stagewise.ir.errors import PartitionError, PlanError, StagewiseError
from stagewise.ir.plan import (
    Cut,
    DeviceSpec,
    Layer,
    LayerCost,
    PlanCosts,
    Program,
    SharedTensor,
    Stage,
    Transfer,
)
from stagewise.ir.time_split import TimeSplit
from stagewise.ir.topology import Topology
from stagewise.passes.activations import Policies, apply_policies, asked_policies, recorded_policies
from stagewise.passes.capacity import HostOver, check_fit, host_bytes, nothing_fits
from stagewise.passes.costs import stage_charges
from stagewise.passes.cpsat import partition_and_bind
from stagewise.passes.early_arrivals import early_arrival_peaks
from stagewise.passes.harmony_plan import HARMONY
from stagewise.passes.layout import PER_STAGE, Grouping, Layout, choose_layout, groupings
from stagewise.passes.lower import lower
from stagewise.passes.partition import balanced_at_legal_cuts
from stagewise.passes.pipedream_dp import NoFeasiblePlan
from stagewise.passes.pipedream_partition import straight_partition
from stagewise.passes.replicate import replicate, replicate_stages
from stagewise.passes.schedule import REPLICATED_STAGE_SCHEDULES, SCHEDULES, instance_tasks
from stagewise.passes.shared import find_shared
from stagewise.passes.sim_split import time_split
from stagewise.passes.simulate import SimCost, SimResult, simulate
from stagewise.passes.stages import build_stages
from stagewise.passes.swap import SwapPlan, plan_swaps

CPSAT_MAX_LAYERS = 160  # exact partition-and-binding: 52 layers on 4 devices solve in 0.1 s
REPLICATING = (Schedule.GPIPE, Schedule.ONE_F_ONE_B, Schedule.TWO_BW, Schedule.ZB_H1, Schedule.VARUNA)  # schedules whose pipelines replicate (P x D)


@dataclass(frozen=True)
class Assembled:
    schedule: Schedule
    microbatches: int
    starts: tuple[int, ...]
    stage_devices: tuple[int, ...]
    layout: Layout
    stages: tuple[Stage, ...]
    transfers: tuple[Transfer, ...]
    shared: tuple[SharedTensor, ...]
    swaps: SwapPlan
    programs: tuple[Program, ...]
    replica_devices: tuple[tuple[int, ...], ...] = ()  # per stage, its replicas' devices (replicated stages)
    host_bytes: tuple[int, ...] = ()  # per device, what the runtime keeps in host memory (passes/capacity.py)

    @property
    def stage_replicas(self) -> tuple[int, ...]:
        """How many ways each stage is replicated, when stages are replicated each their own way."""
        return tuple(len(on) for on in self.replica_devices)


@dataclass(frozen=True)
class Prediction:
    iteration_s: float
    stage_s: tuple[float, ...]  # forward + backward seconds of one microbatch, per stage instance
    peak_bytes: tuple[int, ...]  # per device
    fits: bool  # every device's pool and every host's RAM
    split: TimeSplit | None = None  # where the iteration's time goes (passes/sim_split.py)
    hosts_over: tuple[HostOver, ...] = ()  # the hosts whose RAM cannot hold what the plan keeps there
    pools_fit: bool = True  # every device's pool (only the hosts' RAM may be short)


def assemble(
    gm: fx.GraphModule, layers: tuple[Layer, ...], cuts: Sequence[Cut], traced_microbatch: int, schedule: Schedule, microbatches: int, starts: Sequence[int],
    stage_devices: Sequence[int], layout: Layout, swap: str, capacities: list[int | None], clip: bool,
    state_per_param_byte: float, optimizer_on_host: bool = False, stash_bytes: Sequence[float] = (),
    built: dict | None = None, replica_devices: Sequence[Sequence[int]] = (), grad_bytes: Sequence[float] | None = None,
    activations: ActivationPolicy | Policies = ActivationPolicy.AUTO,
    host_optimizer_bytes: float = 0.0,
) -> Assembled:
    """Stages, replicas, shared tensors, swaps and programs of one plan (`stash_bytes`: what each
    layer stashes per microbatch at the plan's size, for deciding where stashed activations are
    swapped; `grad_bytes`: each layer's trainable parameter bytes, None where every parameter
    trains; `host_optimizer_bytes`: the optimizer's state per trainable byte where it steps on the
    host, for the host memory the plan needs). `traced_microbatch`: the microbatch size `gm`'s values have, which their bytes per
    sample are counted at (a candidate of another size may be built on the same graph: the bytes
    per sample do not depend on the size). `built`: one compile's stages by graph, starts and
    devices, since its candidates share partitions (gpipe, 1f1b and varuna at a microbatch size).
    `replica_devices[s]`: the devices of stage s's replicas when stages are replicated each their own
    way (PipeDream's 2-1 plans); else `layout` copies the whole pipeline. `activations`: every stage's
    policy, or per stage instance (passes/activations.py); AUTO swaps stashes as `swap` says."""
    built = {} if built is None else built
    key = (id(gm), tuple(starts), tuple(stage_devices))
    if key not in built:
        built[key] = build_stages(gm, layers, list(starts), traced_microbatch, device_of=list(stage_devices))
    stages, transfers = built[key]
    if replica_devices:
        stages, transfers = replicate_stages(stages, transfers, replica_devices, microbatches)
    else:
        stages, transfers = replicate(stages, transfers, layout.replicas, microbatches, layout.device_of)
    shared = find_shared(gm, stages)
    # clipping with swapping: lower counts the norm stage by stage (passes/lower.py)
    tasks = instance_tasks(schedule, stages, microbatches, len(capacities), jit_update=not clip)
    tasks, stash_stages = apply_policies(tasks, asked_policies(activations, stages, tasks))
    swaps = plan_swaps(swap, stages, layers, capacities, state_per_param_byte, tasks, stash_bytes, grad_bytes,
                       stash_stages)
    if schedule.weight_versions > 1 and swaps.stages:
        raise PlanError(f"2bw keeps two weight versions on each device, and stages {sorted(swaps.stages)} would swap "
                        "theirs to host memory: give more devices or memory, or use a synchronous schedule")
    programs = lower(stages, transfers, shared, tasks, clip, swaps, optimizer_on_host)
    stages = recorded_policies(stages, tasks, swaps)
    on_host = host_bytes(stages, swaps, tasks, len(capacities), optimizer_on_host, host_optimizer_bytes,
                         schedule.weight_versions)
    return Assembled(schedule, microbatches, tuple(starts), tuple(stage_devices), layout, stages, transfers, shared,
                     swaps, programs, tuple(tuple(on) for on in replica_devices), on_host)


def sim_cost(plan: Assembled, costs: Sequence[LayerCost], devices: Sequence[DeviceSpec], microbatch_size: int,
             topology: Topology, runtime: RuntimeCosts = NO_RUNTIME_COSTS) -> SimCost:
    """What the simulator charges a candidate (passes/costs.py `stage_charges`)."""
    return stage_charges(plan.stages, plan.transfers, plan.swaps.stages, costs, devices, microbatch_size, topology,
                         runtime, plan.shared, plan.schedule.weight_versions)


def recorded_costs(plan: Assembled, costs: Sequence[LayerCost], topology: Topology,
                   runtime: RuntimeCosts = NO_RUNTIME_COSTS) -> PlanCosts:
    """What `sim_cost` reads to charge `plan`, for the IR `Plan` to keep (`costs` at the plan's
    microbatch size): `pipe.simulate()` charges the same from it, after `sw.load` too."""
    return PlanCosts(tuple(costs), topology, runtime, tuple(sorted(plan.swaps.stages)))


def predict(plan: Assembled, costs: Sequence[LayerCost], devices: Sequence[DeviceSpec], microbatch_size: int, topology: Topology,
            runtime: RuntimeCosts = NO_RUNTIME_COSTS) -> tuple[Prediction, SimResult]:
    cost = sim_cost(plan, costs, devices, microbatch_size, topology, runtime)
    result = simulate(plan.programs, cost)
    peaks = early_arrival_peaks(plan.programs, cost, devices, result.peak_bytes)
    fit = check_fit(devices, peaks, plan.host_bytes)
    stage_s = tuple(f + b for f, b in zip(cost.forward_s, cost.backward_s, strict=True))
    return Prediction(result.iteration_time, stage_s, peaks, fit.fits, time_split(result), fit.hosts_over,
                      fit.pools_fit), result


def partition(
    schedule: Schedule, layers: tuple[Layer, ...], cuts: tuple[Cut, ...], costs: Sequence[LayerCost], layout: Layout,
    devices: Sequence[DeviceSpec], microbatch_size: int, topology: Topology,
) -> tuple[list[int], list[int]]:
    """Stage starts and each stage's device for one candidate, over the links of `topology` (one row
    per device)."""
    legal = [c.legal for c in cuts]
    times = [c.fwd_s + c.bwd_s for c in costs]
    positions = layout.positions
    if positions > sum(legal) + 1:
        raise PartitionError(
            f"cannot split the model into {positions} stages: it has only {sum(legal)} legal cut-points "
            f"({sum(legal) + 1} stages at most). Use at most {sum(legal) + 1} devices, or make the model's "
            "blocks finer-grained modules."
        )
    if schedule in (Schedule.INTERLEAVED, Schedule.ZB_V):
        starts = balanced_at_legal_cuts(times, legal, positions, layers, cuts)
        return starts, [layout.device_of(s, 0) for s in range(len(starts))]
    if schedule in HARMONY:  # never partitioned alike: a silent straight pipeline would be wrong
        raise PlanError(f"{schedule}'s packs come from Harmony's search (passes/harmony_search.py), not partition()")
    heterogeneous = len({(d.speed, d.memory) for d in devices}) > 1
    if heterogeneous and layout.replicas == 1 and len(layers) <= CPSAT_MAX_LAYERS:
        return _cpsat(times, cuts, costs, devices, microbatch_size, topology)
    return straight_partition(layers, cuts, costs, layout, devices, microbatch_size, topology)


def _cpsat(times: list[float], cuts: tuple[Cut, ...], costs: Sequence[LayerCost], devices: Sequence[DeviceSpec],
           microbatch_size: int, topology: Topology) -> tuple[list[int], list[int]]:
    memory = [c.state_bytes + c.stash_bytes * len(devices) for c in costs]
    binding = partition_and_bind(times, [c.bytes_per_sample * microbatch_size for c in cuts] + [0.0], memory, devices,
                                 topology, cut_allowed=[c.legal for c in cuts], time_limit_s=5.0)
    return [s.first for s in binding.stages], [s.device for s in binding.stages]


@dataclass(frozen=True)
class Candidate:
    """One plan to try: schedule, microbatch count, data-parallel replicas D and pipeline stages P
    (None: N / D; fewer leaves devices idle), grouped on hosts as `grouping` says (passes/layout.py).
    Or stages replicated each their own way (PipeDream §2.4.1): `stage_replicas` given, e.g. (2, 1),
    or chosen by the DP (`dp_replication`)."""

    schedule: Schedule
    microbatches: int
    replicas: int = 1
    stages: int | None = None
    stage_replicas: tuple[int, ...] = ()
    dp_replication: bool = False
    grouping: Grouping = Grouping.PIPELINES

    @property
    def replicates_stages(self) -> bool:
        return bool(self.stage_replicas) or self.dp_replication

    def describe(self) -> str:
        ways = "-".join(map(str, self.stage_replicas)) or "?"
        return (f"{self.schedule:<11} x{self.microbatches:<3}" + (f" D={self.replicas}" if self.replicas > 1 else "")
                + (f" P={self.stages}" if self.stages is not None else "")
                + (f" replicas {ways}" if self.replicates_stages else "")
                + (" (PipeDream DP)" if self.dp_replication else "")
                + (" stage copies together" if self.grouping is Grouping.STAGE_COPIES else ""))


def candidates(schedule: Schedule, microbatches: int | None, batch: int, n_devices: int, legal_cuts: int,
               needs_swap: bool, replicas: int | str | tuple[int, ...] = 1, stages: int | str | None = None,
               max_stages: int | None = None, hosts: Sequence[int] = ()) -> list[Candidate]:
    """The plans to simulate. replicas="auto" tries every D that divides the devices and the
    microbatches (P x D, Varuna §4.4) for the schedules that replicate; stages="auto" tries every
    pipeline depth P from 1 to N / D (at most `max_stages`) for them (PipeDream's planner may leave
    workers idle, §2.4.1: in-process CPU devices that share too few cores run fewer stages faster),
    grouped on the devices' `hosts` as passes/layout.py `groupings` says. replicas="per-stage" tries,
    for gpipe and 1f1b, the straight pipeline and the DP's replicated stages; replicas=(2, 1) the
    replication given."""
    schedules: list[Schedule]
    if schedule != Schedule.AUTO:
        schedules = [schedule]
    elif needs_swap:
        schedules = [Schedule.HARMONY_PP] + [Schedule.HARMONY_DP] * (n_devices > 1)  # on one device dp runs as pp
    elif isinstance(stages, int):  # a depth is the straight pipelines' to set
        schedules = [Schedule.GPIPE, Schedule.ONE_F_ONE_B]
    else:
        schedules = [Schedule.GPIPE, Schedule.ONE_F_ONE_B] + ([Schedule.INTERLEAVED] if legal_cuts + 1 >= 2 * n_devices else [])
    counts = [microbatches] if microbatches else [m for m in range(1, min(batch, 8 * n_devices) + 1) if batch % m == 0]
    # Harmony's Alg. 1 sweeps every microbatch size (line 6), so every count that divides the batch
    harmony_counts = [microbatches] if microbatches else [m for m in range(1, batch + 1) if batch % m == 0]
    if replicas == PER_STAGE or isinstance(replicas, tuple):
        return _stage_replicated(list(REPLICATED_STAGE_SCHEDULES) if schedule == Schedule.AUTO else schedules, counts, replicas)
    # compiler/assembly/options.py checked them: replicas is now a count or "auto", stages a count, "auto" or None
    given_replicas = replicas if isinstance(replicas, int) else None
    given_stages = stages if isinstance(stages, int) else None
    options = []
    for name in schedules:
        for m in harmony_counts if name in HARMONY else counts:
            if name in (Schedule.INTERLEAVED, Schedule.HARMONY_DP) and m % n_devices:
                continue
            if name not in REPLICATING:  # a number of replicas or stages given for these is refused by the layout
                options.append(Candidate(name, m, 1 if given_replicas is None else given_replicas, given_stages))
                continue
            replica_counts = [d for d in range(1, n_devices + 1) if n_devices % d == 0 and m % d == 0]
            for d in replica_counts if given_replicas is None else [given_replicas]:
                deepest = min(n_devices // d, legal_cuts + 1, max_stages or n_devices)
                depths = list(range(1, deepest + 1)) if stages == "auto" else [given_stages]
                options += [Candidate(name, m, d, p, grouping=g) for p in depths
                            for g in groupings(name, d, p or n_devices // d, hosts)]
    return options


def _stage_replicated(schedules: list[Schedule], counts: list[int], replicas: str | tuple[int, ...]) -> list[Candidate]:
    """PipeDream's replicated stages: the replication given, or the DP's beside the straight pipeline."""
    if isinstance(replicas, tuple):
        return [Candidate(name, m, stage_replicas=replicas) for name in schedules for m in counts]
    return [option for name in schedules for m in counts
            for option in (Candidate(name, m), Candidate(name, m, dp_replication=True))]


PLAN_MARGIN = 0.10  # a faster plan displaces a simpler one only when more than 10% faster (see `keep_simplest`)


class Simplicity(NamedTuple):
    """Where a plan stands in the fixed preference order (lower is simpler): fewer pipeline stages,
    then the schedule's place in SCHEDULES (gpipe, 1f1b, interleaved, varuna, harmony-pp,
    harmony-dp), fewer microbatches, fewer copies; the placement last, so that no two different
    plans tie."""

    stages: int
    schedule: int
    microbatches: int
    copies: int
    placement: tuple[tuple[int, ...], ...]


def simplicity(plan: Assembled) -> Simplicity:
    copies = max(plan.stage_replicas) if plan.replica_devices else plan.layout.replicas
    return Simplicity(len(plan.starts), SCHEDULES.index(plan.schedule), plan.microbatches, copies,
                      (plan.starts, plan.stage_devices, *plan.replica_devices))


def keep_simplest(scored: Sequence[tuple[Simplicity, Prediction]], margin: float = PLAN_MARGIN) -> tuple[int, int]:
    """Indices of the plan to keep and of the fastest, among the plans that fit (at least one must):
    the simplest whose predicted time is within `margin` of the fastest's.

    Why a margin: profiled costs are noisy, and plans whose predictions differ by less than the noise
    would be chosen by chance, so identical scripts would train in different summation orders. The
    figure, measured on this 2-core machine while others shared it: 8 identical compiles (TinyGPT,
    4 layers, dim 64, batch 16 in 4 microbatches, 2 CPU devices, cost="profile", a fresh profile
    cache each) predicted 23-251 ms for the same plan, but each candidate's time over the same
    compile's fastest varied by at most 2.3% (gpipe 1.000-1.023, 1f1b 1.000-1.012, interleaved
    1.036-1.059), and gpipe and 1f1b swapped places. 10% stays well above that spread. Ties in
    time go to the simpler plan, so the choice never depends on the order candidates were tried in."""
    fitting = [i for i, (_, prediction) in enumerate(scored) if prediction.fits]
    fastest = min(fitting, key=lambda i: (scored[i][1].iteration_s, scored[i][0]))
    bound = scored[fastest][1].iteration_s * (1 + margin)
    within = [i for i in fitting if scored[i][1].iteration_s <= bound]
    return min(within, key=lambda i: (scored[i][0], scored[i][1].iteration_s)), fastest


@dataclass(frozen=True)
class Verdict:
    """Which candidate the planner kept, and the fastest, for the table of candidates."""

    kept: Candidate
    kept_s: float
    fastest: Candidate
    fastest_s: float

    def notes(self, tried: Sequence[tuple[Candidate, Prediction | str]]) -> dict[int, str]:
        """What to add to the table's rows: to the kept plan's row, that it was chosen and why; to the
        fastest's, that it is the fastest (the first row of each: Alg. 1 may score a size twice)."""
        def row_of(candidate: Candidate, seconds: float) -> int | None:
            return next((i for i, (option, result) in enumerate(tried) if option == candidate
                         and isinstance(result, Prediction) and result.iteration_s == seconds), None)

        kept, fastest = row_of(self.kept, self.kept_s), row_of(self.fastest, self.fastest_s)
        notes = {} if fastest is None else {fastest: "  <- the fastest"}
        if kept is not None and kept == fastest:
            notes[kept] = f"  <- chosen: the fastest, and no simpler plan within {PLAN_MARGIN:.0%} of it"
        elif kept is not None:
            notes[kept] = (f"  <- chosen: within {PLAN_MARGIN:.0%} of the fastest ({self.kept_s / self.fastest_s - 1:.1%} "
                           "slower), kept the simpler")
        return notes


def choose(
    options: list[Candidate],
    build: Callable[[Candidate], tuple[Assembled, Sequence[LayerCost], int]],
    devices: Sequence[DeviceSpec],
    topology: Topology,
    runtime: RuntimeCosts = NO_RUNTIME_COSTS,
) -> tuple[Assembled, Prediction, list[tuple[Candidate, Prediction | str]], Verdict]:
    """The simplest candidate that fits within PLAN_MARGIN of the fastest that fits (`keep_simplest`);
    the table of all tried, and why the one kept was kept."""
    tried: list[tuple[Candidate, Prediction | str]] = []
    built: list[tuple[Candidate, Assembled, Prediction]] = []
    memory_bound = True  # every candidate that failed to build failed for memory (NoFeasiblePlan)
    for option in options:
        try:
            plan, costs, size = build(option)
        except StagewiseError as error:
            tried.append((option, str(error).splitlines()[0]))
            memory_bound = memory_bound and isinstance(error, NoFeasiblePlan)
            continue
        prediction, _ = predict(plan, costs, devices, size, topology, runtime)
        tried.append((replace(option, stage_replicas=plan.stage_replicas) if option.dp_replication else option,
                      prediction))
        built.append((tried[-1][0], plan, prediction))
    if not built:
        reasons = list(dict.fromkeys(r for _, r in tried))
        failure = NoFeasiblePlan if memory_bound else PartitionError  # memory-bound: recommend says "memory"
        if len(reasons) == 1:
            raise failure(reasons[0])
        raise failure("no plan could be built: " + "; ".join(f"{c.describe().strip()}: {r}" for c, r in tried))
    if not any(prediction.fits for _, _, prediction in built):
        # the reason from the fastest candidate, among those that at least fit the devices' pools
        pooled = [b for b in built if b[2].pools_fit]
        _, plan, prediction = min(pooled or built, key=lambda b: (b[2].iteration_s, simplicity(b[1])))
        raise nothing_fits(f"{plan.schedule}, {plan.microbatches} microbatches", prediction.peak_bytes,
                           prediction.hosts_over, devices)
    kept, fastest = keep_simplest([(simplicity(plan), prediction) for _, plan, prediction in built])
    verdict = Verdict(built[kept][0], built[kept][2].iteration_s, built[fastest][0], built[fastest][2].iteration_s)
    return built[kept][1], built[kept][2], tried, verdict


__all__ = ["PLAN_MARGIN", "Assembled", "Candidate", "Prediction", "RuntimeCosts", "Simplicity", "Verdict", "assemble",
           "candidates", "choose", "choose_layout", "keep_simplest", "partition", "predict", "recorded_costs", "sim_cost",
           "simplicity"]
