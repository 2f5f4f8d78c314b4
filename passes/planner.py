"""The planner: partition, assemble and simulate candidate plans; keep the fastest that fits.

For each candidate (schedule x microbatch count) it partitions the layers from their costs at
that microbatch size: PipeDream's dynamic program (§2.4.1) over contiguous layers for equal
devices, OR-Tools CP-SAT partition-and-binding when devices differ in speed or memory (Harmony's
packs and microbatch size come from its Alg. 1 and 2: passes/harmony_search.py); the DP and
CP-SAT read the links between the devices from their `Topology` (ir/topology.py: measured by compile). With replicas="per-stage"
the DP may also replicate single stages (a 2-1 plan), a candidate beside the straight pipeline
(passes/pipedream_partition.py). It then lowers the
candidate to the same instruction programs the runtime executes and simulates them (Srifty
§3.3: an event-driven simulator over per-layer costs and the same links), and keeps the lowest
predicted iteration time whose predicted per-device peak memory fits every device (Harmony
§4.3, Varuna §4.4).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch.fx as fx

from stagewise.ir.costs import NO_RUNTIME_COSTS, RuntimeCosts
from stagewise.ir.devices import format_bytes
from stagewise.ir.errors import CapacityError, PartitionError, PlanError, StagewiseError
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
from stagewise.ir.topology import Topology
from stagewise.passes.costs import stage_charges
from stagewise.passes.cpsat import partition_and_bind
from stagewise.passes.harmony_packing import split_balanced
from stagewise.passes.harmony_plan import HARMONY
from stagewise.passes.layout import PER_STAGE, Layout, choose_layout
from stagewise.passes.lower import lower
from stagewise.passes.partition import balanced_starts
from stagewise.passes.pipedream_partition import straight_partition
from stagewise.passes.replicate import replicate, replicate_stages
from stagewise.passes.schedule import REPLICATED_STAGE_SCHEDULES, instance_tasks
from stagewise.passes.shared import find_shared
from stagewise.passes.simulate import SimCost, SimResult, simulate
from stagewise.passes.stages import build_stages
from stagewise.passes.swap import SwapPlan, plan_swaps

CPSAT_MAX_LAYERS = 160  # exact partition-and-binding: 52 layers on 4 devices solve in 0.1 s
REPLICATING = ("gpipe", "1f1b", "varuna")  # schedules whose pipelines replicate (P x D)


@dataclass(frozen=True)
class Assembled:
    schedule: str
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

    @property
    def stage_replicas(self) -> tuple[int, ...]:
        """How many ways each stage is replicated, when stages are replicated each their own way."""
        return tuple(len(on) for on in self.replica_devices)


@dataclass(frozen=True)
class Prediction:
    iteration_s: float
    stage_s: tuple[float, ...]  # forward + backward seconds of one microbatch, per stage instance
    peak_bytes: tuple[int, ...]  # per device
    fits: bool


def assemble(
    gm: fx.GraphModule, layers, cuts, traced_microbatch: int, schedule: str, microbatches: int, starts: Sequence[int],
    stage_devices: Sequence[int], layout: Layout, swap: str, capacities: list[int | None], clip: bool,
    state_per_param_byte: float, optimizer_on_host: bool = False, stash_bytes: Sequence[float] = (),
    built: dict | None = None, replica_devices: Sequence[Sequence[int]] = (),
) -> Assembled:
    """Stages, replicas, shared tensors, swaps and programs of one plan (`stash_bytes`: what each
    layer stashes per microbatch at the plan's size, for deciding where stashed activations are
    swapped). `traced_microbatch`: the microbatch size `gm`'s values have, which their bytes per
    sample are counted at (a candidate of another size may be built on the same graph: the bytes
    per sample do not depend on the size). `built`: one compile's stages by graph, starts and
    devices, since its candidates share partitions (gpipe, 1f1b and varuna at a microbatch size).
    `replica_devices[s]`: the devices of stage s's replicas when stages are replicated each their own
    way (PipeDream's 2-1 plans); else `layout` copies the whole pipeline."""
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
    swaps = plan_swaps(swap, stages, layers, capacities, state_per_param_byte, tasks, stash_bytes)
    programs = lower(stages, transfers, shared, tasks, clip, swaps, optimizer_on_host)
    return Assembled(schedule, microbatches, tuple(starts), tuple(stage_devices), layout, stages, transfers, shared,
                     swaps, programs, tuple(tuple(on) for on in replica_devices))


def sim_cost(plan: Assembled, costs: Sequence[LayerCost], devices: Sequence[DeviceSpec], microbatch_size: int,
             topology: Topology, runtime: RuntimeCosts = NO_RUNTIME_COSTS) -> SimCost:
    """What the simulator charges a candidate (passes/costs.py `stage_charges`)."""
    return stage_charges(plan.stages, plan.transfers, plan.swaps.stages, costs, devices, microbatch_size, topology,
                         runtime, plan.shared)


def recorded_costs(plan: Assembled, costs: Sequence[LayerCost], topology: Topology,
                   runtime: RuntimeCosts = NO_RUNTIME_COSTS) -> PlanCosts:
    """What `sim_cost` reads to charge `plan`, for the IR `Plan` to keep (`costs` at the plan's
    microbatch size): `pipe.simulate()` charges the same from it, after `sw.load` too."""
    return PlanCosts(tuple(costs), topology, runtime, tuple(sorted(plan.swaps.stages)))


def predict(plan: Assembled, costs, devices, microbatch_size: int, topology: Topology,
            runtime: RuntimeCosts = NO_RUNTIME_COSTS) -> tuple[Prediction, SimResult]:
    cost = sim_cost(plan, costs, devices, microbatch_size, topology, runtime)
    result = simulate(plan.programs, cost)
    peaks = tuple(int(result.peak_bytes.get(d, 0)) for d in range(len(devices)))
    fits = all(d.memory is None or peak <= d.memory for d, peak in zip(devices, peaks, strict=True))
    stage_s = tuple(f + b for f, b in zip(cost.forward_s, cost.backward_s, strict=True))
    return Prediction(result.iteration_time, stage_s, peaks, fits), result


def partition(
    schedule: str, layers: tuple[Layer, ...], cuts: tuple[Cut, ...], costs: Sequence[LayerCost], layout: Layout,
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
    if schedule == "interleaved":
        starts = _balanced_at_legal(times, legal, positions, layers, cuts)
        return starts, [layout.device_of(s, 0) for s in range(len(starts))]
    if schedule in HARMONY:  # never partitioned alike: a silent straight pipeline would be wrong
        raise PlanError(f"{schedule}'s packs come from Harmony's search (passes/harmony_search.py), not partition()")
    heterogeneous = len({(d.speed, d.memory) for d in devices}) > 1
    if heterogeneous and layout.replicas == 1 and len(layers) <= CPSAT_MAX_LAYERS:
        return _cpsat(times, cuts, costs, devices, microbatch_size, topology)
    return straight_partition(layers, cuts, costs, layout, devices, microbatch_size, topology)


def _balanced_at_legal(times, legal, count: int, layers, cuts) -> list[int]:
    """Harmony's balanced time packing (Alg. 2 l. 7-11), moved to the nearest legal cut."""
    packs = split_balanced(times, count)
    starts = [0]
    allowed = [i + 1 for i, ok in enumerate(legal) if ok]
    for pack in packs[1:]:
        later = [a for a in allowed if a > starts[-1]]
        if not later:
            break
        starts.append(min(later, key=lambda a: abs(a - pack.start)))
    if len(starts) < count:
        return balanced_starts(layers, cuts, count)
    return starts


def _cpsat(times, cuts, costs, devices, microbatch_size: int, topology: Topology) -> tuple[list[int], list[int]]:
    memory = [c.state_bytes + c.stash_bytes * len(devices) for c in costs]
    binding = partition_and_bind(times, [c.bytes_per_sample * microbatch_size for c in cuts] + [0.0], memory, devices,
                                 topology, cut_allowed=[c.legal for c in cuts], time_limit_s=5.0)
    return [s.first for s in binding.stages], [s.device for s in binding.stages]


@dataclass(frozen=True)
class Candidate:
    """One plan to try: schedule, microbatch count, data-parallel replicas D and pipeline stages P
    (None: what the layout gives, N / D; fewer leaves devices idle). Or stages replicated each their
    own way (PipeDream §2.4.1): `stage_replicas` given, e.g. (2, 1), or chosen by the DP
    (`dp_replication`)."""

    schedule: str
    microbatches: int
    replicas: int = 1
    stages: int | None = None
    stage_replicas: tuple[int, ...] = ()
    dp_replication: bool = False

    @property
    def replicates_stages(self) -> bool:
        return bool(self.stage_replicas) or self.dp_replication

    def describe(self) -> str:
        ways = "-".join(map(str, self.stage_replicas)) or "?"
        return (f"{self.schedule:<11} x{self.microbatches:<3}" + (f" D={self.replicas}" if self.replicas > 1 else "")
                + (f" P={self.stages}" if self.stages is not None else "")
                + (f" replicas {ways}" if self.replicates_stages else "")
                + (" (PipeDream DP)" if self.dp_replication else ""))


def candidates(schedule: str, microbatches: int | None, batch: int, n_devices: int, legal_cuts: int,
               needs_swap: bool, replicas: int | str | tuple[int, ...] = 1, stages: int | str | None = None,
               max_stages: int | None = None) -> list[Candidate]:
    """The plans to simulate. replicas="auto" tries every D that divides the devices and the
    microbatches (P x D, Varuna §4.4) for the schedules that replicate; stages="auto" tries every
    pipeline depth P from 1 to N / D (at most `max_stages`) for them (PipeDream's planner may leave
    workers idle, §2.4.1: in-process CPU devices that share too few cores run fewer stages faster).
    replicas="per-stage" tries, for gpipe and 1f1b, the straight pipeline and the DP's replicated
    stages; replicas=(2, 1) the replication given."""
    if schedule != "auto":
        schedules = [schedule]
    elif needs_swap:
        schedules = ["harmony-pp", "harmony-dp"]
    elif isinstance(stages, int):  # a depth is the straight pipelines' to set
        schedules = ["gpipe", "1f1b"]
    else:
        schedules = ["gpipe", "1f1b"] + (["interleaved"] if legal_cuts + 1 >= 2 * n_devices else [])
    counts = [microbatches] if microbatches else [m for m in range(1, min(batch, 8 * n_devices) + 1) if batch % m == 0]
    # Harmony's Alg. 1 sweeps every microbatch size (line 6), so every count that divides the batch
    harmony_counts = [microbatches] if microbatches else [m for m in range(1, batch + 1) if batch % m == 0]
    if replicas == PER_STAGE or isinstance(replicas, tuple):
        return _stage_replicated(list(REPLICATED_STAGE_SCHEDULES) if schedule == "auto" else schedules, counts, replicas)
    options = []
    for name in schedules:
        for m in harmony_counts if name in HARMONY else counts:
            if name in ("interleaved", "harmony-dp") and m % n_devices:
                continue
            if name not in REPLICATING:  # a number of replicas or stages given for these is refused by the layout
                options.append(Candidate(name, m, 1 if replicas == "auto" else replicas,
                                         stages if isinstance(stages, int) else None))
                continue
            ds = [d for d in range(1, n_devices + 1) if n_devices % d == 0 and m % d == 0] if replicas == "auto" else [replicas]
            for d in ds:
                if stages == "auto":
                    deepest = min(n_devices // d, legal_cuts + 1, max_stages or n_devices)
                    options += [Candidate(name, m, d, p) for p in range(1, deepest + 1)]
                else:
                    options.append(Candidate(name, m, d, stages))
    return options


def _stage_replicated(schedules: list[str], counts: list[int], replicas: str | tuple[int, ...]) -> list[Candidate]:
    """PipeDream's replicated stages: the replication given, or the DP's beside the straight pipeline."""
    if isinstance(replicas, tuple):
        return [Candidate(name, m, stage_replicas=replicas) for name in schedules for m in counts]
    return [option for name in schedules for m in counts
            for option in (Candidate(name, m), Candidate(name, m, dp_replication=True))]


def choose(
    options: list[Candidate],
    build: Callable[[Candidate], tuple[Assembled, Sequence[LayerCost], int]],
    devices: Sequence[DeviceSpec],
    topology: Topology,
    runtime: RuntimeCosts = NO_RUNTIME_COSTS,
) -> tuple[Assembled, Prediction, list[tuple[Candidate, Prediction | str]]]:
    """The candidate with the lowest predicted iteration time that fits; the table of all tried."""
    tried: list[tuple[Candidate, Prediction | str]] = []
    best = None
    for option in options:
        try:
            plan, costs, size = build(option)
        except StagewiseError as error:
            tried.append((option, str(error).splitlines()[0]))
            continue
        prediction, _ = predict(plan, costs, devices, size, topology, runtime)
        tried.append((replace(option, stage_replicas=plan.stage_replicas) if option.dp_replication else option,
                      prediction))
        key = (not prediction.fits, prediction.iteration_s)
        if best is None or key < best[0]:
            best = (key, plan, prediction)
    if best is None:
        reasons = list(dict.fromkeys(r for _, r in tried))
        if len(reasons) == 1:
            raise PartitionError(reasons[0])
        raise PartitionError("no plan could be built: " + "; ".join(f"{c.describe().strip()}: {r}" for c, r in tried))
    _, plan, prediction = best
    if not prediction.fits:
        over = [(d, peak, spec.memory) for d, (peak, spec) in enumerate(zip(prediction.peak_bytes, devices, strict=True))
                if spec.memory is not None and peak > spec.memory]
        detail = ", ".join(f"device {d} would need {format_bytes(peak)} of its {format_bytes(cap)}" for d, peak, cap in over)
        raise CapacityError(
            f"no plan fits the devices' memory even with swapping: the best ({plan.schedule}, {plan.microbatches} "
            f"microbatches) predicts {detail}. Give the devices more memory, add devices, use a smaller batch or "
            "more microbatches (smaller activations)."
        )
    return plan, prediction, tried


__all__ = ["Assembled", "Candidate", "Prediction", "RuntimeCosts", "assemble", "candidates", "choose", "choose_layout",
           "partition", "predict", "recorded_costs", "sim_cost"]
