"""`stagewise.compile`: trace -> layers -> cut-points -> plan (partition, schedule, swaps) -> programs -> codegen."""

from __future__ import annotations

import functools
import sys
import time
import warnings

import torch
import torch.fx as fx

from stagewise.codegen.stages import build_stage_modules
from stagewise.compiler.calibrate import (
    handoff_seconds,
    optimizer_cost,
    optimizer_state_ratio,
    send_bandwidth,
)
from stagewise.compiler.pipeline import Pipeline
from stagewise.compiler.trace import capture, input_names
from stagewise.ir.devices import Device, resolve_devices
from stagewise.ir.errors import (
    BatchSizeError,
    ExampleInputsError,
    OversubscribedWarning,
    PartitionError,
    PlanError,
)
from stagewise.ir.plan import Plan
from stagewise.passes.analytic import analytic_layers
from stagewise.passes.contention import available_cores, computes_at_full_speed, host_contention
from stagewise.passes.cutpoints import find_cuts
from stagewise.passes.layers import build_layers
from stagewise.passes.layout import choose_layout
from stagewise.passes.partition import starts_from_split_points
from stagewise.passes.planner import (
    REPLICATING,
    Assembled,
    Candidate,
    Prediction,
    RuntimeCosts,
    assemble,
    candidates,
    choose,
    partition,
    predict,
    sim_cost,
)
from stagewise.passes.profile import costs_at, profile_layers
from stagewise.passes.schedule import SCHEDULES
from stagewise.passes.shared import alias_groups
from stagewise.runtime.launch import distributed_context

DEFAULT_OPTIMIZER = functools.partial(torch.optim.SGD, lr=0.01)
COST_MODELS = ("profile", "analytic")


def compile(  # noqa: A001 - the public name of the API
    model: torch.nn.Module,
    devices,
    example_inputs,
    *,
    loss_fn=None,
    example_target=None,
    optimizer=None,
    microbatches: int | None = None,
    schedule: str = "auto",
    cost: str = "profile",
    split_points: list[str] | None = None,
    clip_grad_norm: float | None = None,
    swap: str = "auto",
    replicas: int | str = 1,
    stages: int | str | None = None,
    optimizer_on_host: bool = False,
) -> Pipeline:
    """Compile `model` into a pipeline over `devices` that trains exactly like eager training.

    With `schedule="auto"` and `microbatches=None` the planner simulates candidate plans and
    keeps the fastest that fits every device's memory. `cost`: "profile" measures each layer
    on this machine (cached on disk), "analytic" derives times from FLOPs and the devices'
    peak rates. `swap`: "auto" swaps state (weights, gradients, optimizer state) to host memory
    only where a device's capacity requires it, "on" forces Harmony-style swapping of state,
    "per-device" the per-GPU baseline, "off" never swaps anything. Stashed activations (what
    autograd keeps from a microbatch's forward for its backward) go to host memory between the
    two where a device cannot hold the stashes its schedule keeps in flight beside its state, in
    every mode but "off"; "all" is "on" plus swapping every stage's stashed activations
    (Harmony's sX; the least device memory, the most host traffic; a stash whose backward is the
    device's next task stays). `replicas`: data-parallel copies of the pipeline (P x D, P =
    devices / replicas); "auto" lets the planner simulate every D that divides the devices and the
    microbatch count and keep the fastest, as Varuna's configuration search does (§4.4).
    `stages`: the depth P of a gpipe / 1f1b / varuna pipeline (default: every device, N / D); fewer
    leaves devices idle; "auto" lets the planner simulate every depth from 1 and keep the fastest
    (PipeDream's planner may use fewer workers, §2.4.1): in-process CPU devices that share fewer
    cores than there are devices run fewer, larger stages faster.
    `optimizer_on_host`: run the optimizer step on the host (Harmony's CPU update, ZeRO-Offload):
    each update copies the stage's gradients to host memory, steps fp32 master weights there with
    the optimizer state kept beside them, and copies the weights back to the device, so no device
    ever holds optimizer state and its memory goes to weights, gradients and activations.
    """
    if not isinstance(model, torch.nn.Module):
        raise ExampleInputsError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if cost not in COST_MODELS:
        raise PlanError(f"unknown cost={cost!r}; choose 'profile' (measure) or 'analytic' (FLOPs and peak rates)")
    if schedule not in SCHEDULES:
        raise PlanError(f"unknown schedule {schedule!r}; choose one of {', '.join(SCHEDULES)}")
    if replicas != "auto" and (not isinstance(replicas, int) or replicas < 1):
        raise PlanError(f"replicas must be a positive int or 'auto', got {replicas!r}")
    if stages not in (None, "auto") and (not isinstance(stages, int) or stages < 1):
        raise PlanError(f"stages must be a positive int, 'auto' or None (every device), got {stages!r}")
    timer = _PhaseTimer()
    resolved = resolve_devices(devices)
    _warn_if_oversubscribed(resolved)
    names, kind = input_names(model, example_inputs)
    batch = batch_size(example_inputs, example_target)
    if microbatches is not None:
        check_microbatches(batch, microbatches)
    first_m = microbatches or max(d for d in range(1, len(resolved) + 1) if batch % d == 0)
    # one microbatch count known in advance: a static export (about half the time of a symbolic one)
    analysis = _Analysis(model, example_inputs, example_target, loss_fn, batch, first_m,
                         dynamic=microbatches is None and split_points is None)
    timer.lap("trace")
    specs = [d.spec() for d in resolved]
    capacities = [d.memory for d in resolved]
    bandwidth = send_bandwidth(resolved[0], resolved[-1]) if len(resolved) > 1 else float("inf")
    clip = clip_grad_norm is not None
    optimizer = optimizer or DEFAULT_OPTIMIZER
    optimizer_ratio = 0.0 if optimizer_on_host else optimizer_state_ratio(optimizer)  # on the devices
    state_ratio = 2 + optimizer_ratio  # weights + gradients + optimizer state, per weight byte
    costs = _cost_model(cost, analysis, resolved[0], optimizer_ratio)
    costs(analysis.at(first_m)[3])
    runtime = _runtime_costs(cost, analysis, resolved, optimizer, costs)
    timer.lap(f"costs ({cost})")

    partitions: dict[tuple, tuple[list[int], list[int]]] = {}
    built: dict[tuple, tuple] = {}  # stages per partition, shared by the candidates that partition alike

    def build(candidate: Candidate, fixed: tuple | None = None, exact: bool = False) -> tuple[Assembled, list, int]:
        """One candidate plan, on the first trace (layers and per-sample bytes do not depend on the
        microbatch size), or `exact`ly on a trace at this size (what the runtime needs). `fixed` =
        (stage starts, stage devices) decided elsewhere (the planner, or rank 0)."""
        name, m = candidate.schedule, candidate.microbatches
        gm, layers, cuts, _ = analysis.at(m if exact else analysis.first_m)
        size = batch // m
        legal = sum(c.legal for c in cuts)
        params = sum(layer.param_bytes for layer in layers)
        layout = choose_layout(name, len(resolved), candidate.replicas, legal, params,
                               min((c for c in capacities if c), default=None), state_ratio, candidate.stages)
        layer_costs = costs(size)
        if fixed is not None:
            starts, stage_devices = fixed
        elif split_points is not None:
            starts = starts_from_split_points(layers, cuts, list(split_points))
            if len(starts) != layout.positions:
                raise PartitionError(
                    f"split_points gives {len(starts)} stages but {len(resolved)} devices with schedule {name!r} "
                    f"need {layout.positions}; give {layout.positions - 1} split points, or stages={len(starts)}"
                )
            stage_devices = [layout.device_of(s, 0) for s in range(len(starts))]
        else:
            key = ("pipeline" if name in ("gpipe", "1f1b", "varuna") else name, size, layout.positions, layout.replicas)
            if key not in partitions:
                partitions[key] = partition(name, layers, cuts, layer_costs, layout, specs, size, bandwidth)
            starts, stage_devices = partitions[key]
        plan = assemble(gm, layers, cuts, size, name, m, starts, stage_devices, layout, swap, capacities, clip, state_ratio,
                        optimizer_on_host=optimizer_on_host, stash_bytes=[c.stash_bytes for c in layer_costs],
                        built=built)
        return plan, layer_costs, size

    searched = "auto" in (replicas, stages) and split_points is None
    if split_points is not None or (schedule != "auto" and microbatches is not None and not searched):
        chosen_name = "gpipe" if schedule == "auto" else schedule
        chosen, layer_costs, size = build(Candidate(chosen_name, first_m, 1 if replicas == "auto" else replicas,
                                                    None if stages == "auto" else stages), exact=True)
        prediction, _ = predict(chosen, layer_costs, specs, size, bandwidth, runtime)
        considered = ()
    else:
        needs_swap = _needs_swap(analysis, capacities, swap, state_ratio)
        legal = sum(c.legal for c in analysis.at(first_m)[2])
        options = candidates(schedule, microbatches, batch, len(resolved), legal, needs_swap, replicas, stages,
                             _stages_at_full_speed(resolved))
        chosen, prediction, tried = choose(options, build, specs, bandwidth, runtime)
        considered = tuple(_describe(option, result) for option, result in tried)
    chosen = _agree_across_ranks(chosen, build)
    chosen = _exactly(chosen, build, analysis)
    gm, layers, cuts, size = analysis.at(chosen.microbatches)
    timer.lap("plan (partition, schedule, lower, simulate)")
    plan = Plan(
        model=type(model).__name__,
        tracer=analysis.tracer,
        devices=tuple(specs),
        input_names=tuple(names),
        input_kind=kind,
        target_name=analysis.target_name,
        graph_inputs=analysis.graph_inputs,
        microbatches=chosen.microbatches,
        microbatch_size=size,
        schedule=chosen.schedule,
        layers=layers,
        cuts=cuts,
        shared=chosen.shared,
        stages=chosen.stages,
        transfers=chosen.transfers,
        programs=chosen.programs,
        state_names=tuple(model.state_dict().keys()),
        aliases=tuple(alias_groups(gm)),
        cost_model=cost,
        predicted_iteration_s=prediction.iteration_s,
        predicted_stage_s=prediction.stage_s,
        predicted_peak_bytes=prediction.peak_bytes,
        considered=considered,
    )
    modules = build_stage_modules(gm, layers, chosen.stages)
    pipe = Pipeline(plan, modules, optimizer, clip_grad_norm, chosen.swaps.stages)
    pipe.sim_cost = sim_cost(chosen, costs(size), specs, size, bandwidth, runtime)
    timer.lap("codegen and runtime set-up")
    pipe.compile_times = timer.laps
    return pipe


class _PhaseTimer:
    """Seconds spent in each compile phase, for `pipe.compile_times`."""

    def __init__(self):
        self.laps: dict[str, float] = {}
        self.last = time.perf_counter()

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.laps[name] = self.laps.get(name, 0.0) + now - self.last
        self.last = now


class _Analysis:
    """The model captured once, and per microbatch count the graph at that microbatch size with its
    layers and cut-points (node values, transfer shapes and the literal sizes in the stage code are
    per size). `dynamic` (the planner weighs several counts): torch.export is asked once for a graph
    with a symbolic batch, which every size is evaluated from; a model that cannot keep its batch
    symbolic is exported again at each size (compiler/trace.Capture). fx graphs are traced once
    either way. With one count known in advance, `dynamic=False` exports statically: about half
    the time of a symbolic export."""

    def __init__(self, model, example_inputs, example_target, loss_fn, batch: int, first_m: int, *,
                 dynamic: bool = True):
        self.model, self.inputs, self.target, self.loss_fn, self.batch = model, example_inputs, example_target, loss_fn, batch
        self.dynamic = dynamic
        self.cache: dict[int, tuple] = {}
        # Export at a size of at least 2 where the batch allows: export fixes a size of 1 (0/1 specialisation).
        example_m = first_m
        if dynamic and batch // first_m < 2 and batch > 1:
            example_m = max(m for m in range(1, batch) if batch % m == 0 and batch // m >= 2)
        self.capture = capture(model, split_batch(example_inputs, example_m)[0], _first(example_target, example_m),
                               loss_fn, dynamic=dynamic)
        self.tracer, self.target_name = self.capture.tracer, self.capture.target_name
        self.at(first_m)
        self.first_m = first_m

    def at(self, m: int):
        if m not in self.cache:
            size = self.batch // m
            traced = self.capture.at(split_batch(self.inputs, m)[0], _first(self.target, m))
            gm = traced.graph_module
            layers = build_layers(gm, self.model)
            self.cache[m] = (gm, layers, find_cuts(gm, layers, size), size)
            self.graph_inputs = traced.graph_inputs
        return self.cache[m]

    def graph_at_size(self, u: int) -> fx.GraphModule:
        """The graph at microbatch size u (the profiler's probes): the example's first u samples,
        repeated where the example has fewer."""
        def rows(value):
            if not isinstance(value, torch.Tensor) or value.dim() == 0:
                return value
            return value.repeat(-(-u // value.shape[0]), *[1] * (value.dim() - 1))[:u]

        inputs = {k: rows(v) for k, v in self.inputs.items()} if isinstance(self.inputs, dict) else tuple(
            rows(v) for v in self.inputs)
        return self.capture.at(inputs, rows(self.target)).graph_module


def _cost_model(cost: str, analysis: _Analysis, device: Device, optimizer_ratio: float):
    """Per-layer costs at a microbatch size, from one profile (or analytic model) of the first trace."""
    gm, layers, _, size = analysis.at(analysis.first_m)

    @functools.cache
    def profiles():
        if cost == "analytic":
            return analytic_layers(gm, layers, size, device, optimizer_state_factor=optimizer_ratio)
        return profile_layers(gm, layers, device, traced_microbatch=size, quiet=not sys.stderr.isatty(),
                              optimizer_state_factor=optimizer_ratio,
                              # several sizes matter only to a planner that weighs several counts; a static
                              # export would be exported again for each
                              graph_at=analysis.graph_at_size if analysis.dynamic else None)

    return lambda u: costs_at(profiles(), u)


def _runtime_costs(cost: str, analysis: _Analysis, devices: list[Device], optimizer, costs) -> RuntimeCosts:
    """What the runtime adds on this machine: per-instruction hand-offs, contention between the
    in-process CPU devices (measured on the model's costliest layer kind with cost="profile", the
    cores' share with cost="analytic"), and the optimizer step, timed on the first device."""
    gm, layers, _, size = analysis.at(analysis.first_m)
    sharing = sum(d.torch_device.type == "cpu" for d in devices) if distributed_context() is None else 1
    concurrency: tuple[float, ...] = ()
    update_concurrency: tuple[float, ...] = ()
    wake_s = 0.0
    if sharing > 1 and cost == "profile":
        measured = host_contention(gm, layers, costs(size), size, sharing, optimizer)
        concurrency, wake_s, update_concurrency = measured.speeds, measured.wake_s, measured.update_speeds
    elif sharing > 1:
        cores = computes_at_full_speed()
        concurrency = tuple(min(1.0, cores / k) for k in range(1, sharing + 1))
    step = optimizer_cost(optimizer, devices[0])
    update = tuple(step.seconds(len(layer.params), layer.param_bytes) for layer in layers)
    return RuntimeCosts(instruction_s=handoff_seconds(), concurrency=concurrency, update_s=update, wake_s=wake_s,
                        update_concurrency=update_concurrency)


def _warn_if_oversubscribed(devices: list[Device]) -> None:
    """Each in-process CPU device computes on its own thread with torch's intra-op threads; when they
    add up to more than the cores, OpenMP teams wait for descheduled members on every op (the demo's
    GPT-2 on 4 devices stepped in 135 ms with 2 threads each on 2 cores, 96 ms with 1)."""
    cpu = sum(d.torch_device.type == "cpu" for d in devices) if distributed_context() is None else 1
    cores = available_cores()
    threads = torch.get_num_threads()
    if cpu > 1 and threads > max(1, cores // cpu):
        warnings.warn(
            f"{cpu} CPU devices in this process, each computing with {threads} intra-op threads, oversubscribe "
            f"the {cores} cores available; call torch.set_num_threads({max(1, cores // cpu)}) before compiling "
            "(or run one process per device under torchrun)", OversubscribedWarning, stacklevel=3)


def _stages_at_full_speed(devices: list[Device]) -> int | None:
    """The deepest pipeline stages="auto" tries on in-process CPU devices: one stage per core that
    computes at full speed. More compute threads than cores only time-slice, and a stage preempted
    mid-compute holds up the whole pipeline, which processor sharing in the simulator does not
    see (3 stages on this 2-core machine measured 5-18% slower than predicted, 2 stages 1-9%)."""
    if distributed_context() is not None or any(d.torch_device.type != "cpu" for d in devices):
        return None
    return max(1, int(computes_at_full_speed()))


def _needs_swap(analysis: _Analysis, capacities: list[int | None], swap: str, state_ratio: float) -> bool:
    if swap in ("on", "all", "per-device"):
        return True
    if swap == "off" or all(c is None for c in capacities):
        return False
    layers = analysis.at(analysis.first_m)[1]
    state = state_ratio * sum(layer.param_bytes for layer in layers)
    return state > sum(c for c in capacities if c) * 0.75


def _describe(candidate: Candidate, result: Prediction | str) -> str:
    what = candidate.describe()
    if isinstance(result, str):
        return f"{what} not possible: {result}"
    fits = "fits" if result.fits else "does not fit"
    return f"{what} {result.iteration_s * 1e3:9.2f} ms/iteration, {fits}"


def _exactly(chosen: Assembled, build, analysis: _Analysis) -> Assembled:
    """The chosen plan rebuilt on the graph at its own microbatch size (transfer shapes, the sizes in
    export graphs' stage code); the same capture, evaluated at that size (no new trace, but where
    the model could not keep its batch symbolic)."""
    if chosen.microbatches == analysis.first_m:
        return chosen
    layers = analysis.at(chosen.microbatches)[1]
    if len(layers) != len(analysis.at(analysis.first_m)[1]):  # the graph changed with the size: plan again on it
        return build(_candidate_of(chosen), exact=True)[0]
    return build(_candidate_of(chosen), fixed=(list(chosen.starts), list(chosen.stage_devices)), exact=True)[0]


def _candidate_of(plan: Assembled) -> Candidate:
    stages = plan.layout.positions if plan.schedule in REPLICATING else None
    return Candidate(plan.schedule, plan.microbatches, plan.layout.replicas, stages)


def _agree_across_ranks(chosen: Assembled, build) -> Assembled:
    """Under torch.distributed every rank must run the same plan: rank 0's choice wins."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return chosen
    mine = (_candidate_of(chosen), chosen.starts, chosen.stage_devices)
    decision = [mine]
    torch.distributed.broadcast_object_list(decision, src=0)
    if decision[0] == mine:
        return chosen
    return _rebuild(decision[0], build)


def _rebuild(decision, build) -> Assembled:
    """This rank's measurements led elsewhere: build rank 0's plan here."""
    candidate, starts, stage_devices = decision
    plan, _, _ = build(candidate, fixed=(list(starts), list(stage_devices)), exact=True)
    return plan


def batch_size(example_inputs, example_target) -> int:
    values = list(example_inputs.values()) if isinstance(example_inputs, dict) else list(example_inputs)
    for value in values:
        if not isinstance(value, torch.Tensor):
            raise ExampleInputsError(
                f"example_inputs holds a {type(value).__name__}; stagewise needs tensors "
                "(drop None arguments, and pass Python constants through the model's config)"
            )
    if not values:
        raise ExampleInputsError("example_inputs is empty: give at least one input tensor")
    sizes = {v.shape[0] for v in values if v.dim() > 0}
    if isinstance(example_target, torch.Tensor) and example_target.dim() > 0:
        sizes.add(example_target.shape[0])
    if len(sizes) != 1:
        raise ExampleInputsError(
            f"inputs disagree on the batch size (dim 0 sizes {sorted(sizes)}); every input and the target "
            "must carry the batch along dim 0"
        )
    return sizes.pop()


def check_microbatches(batch: int, microbatches: int) -> None:
    if not isinstance(microbatches, int) or microbatches < 1:
        raise BatchSizeError(f"microbatches must be a positive int, got {microbatches!r}")
    if batch % microbatches:
        divisors = [d for d in range(1, batch + 1) if batch % d == 0]
        raise BatchSizeError(
            f"batch size {batch} is not divisible by microbatches={microbatches}; "
            f"use one of {divisors} microbatches or a batch size that is a multiple of {microbatches}"
        )


def split_batch(inputs, microbatches: int) -> list:
    """The minibatch's inputs as `microbatches` equal slices along dim 0, in the same form."""
    if isinstance(inputs, dict):
        chunks = {k: v.chunk(microbatches) if v.dim() else [v] * microbatches for k, v in inputs.items()}
        return [{k: c[i] for k, c in chunks.items()} for i in range(microbatches)]
    chunks = [v.chunk(microbatches) if v.dim() else [v] * microbatches for v in inputs]
    return [tuple(c[i] for c in chunks) for i in range(microbatches)]


def _first(target, microbatches: int):
    if isinstance(target, torch.Tensor) and target.dim() > 0:
        return target.chunk(microbatches)[0]
    return target
