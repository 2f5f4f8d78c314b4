"""`stagewise.compile`: check the arguments, then run the compile phases (compiler/compile/phases.py):
capture -> analyse -> cost -> plan -> codegen -> runtime."""

from __future__ import annotations

import torch
import torch.fx as fx

from stagewise.compiler.assembly.fx_sources import releasing_fx_sources
from stagewise.compiler.assembly.loss_reduction import check_loss_reduction, model_reduction
from stagewise.compiler.assembly.option_groups import (
    MemoryOptions,
    PlanOptions,
    TrainingOptions,
    given_once,
    with_groups,
)
from stagewise.compiler.assembly.options import (
    DEFAULT_OPTIMIZER,
    CompileOptions,
    CompileRequest,
    check_split_points,
)
from stagewise.compiler.assembly.shape_buckets import (
    Padding,
    ShapeBuckets,
    parse_shape_buckets,
    sequence_length,
)
from stagewise.compiler.compile.analysis import Analysis
from stagewise.compiler.compile.context import CompileContext, after
from stagewise.compiler.compile.model_graph import describe_model
from stagewise.compiler.compile.padding_check import bucket_padding
from stagewise.compiler.compile.phases import PHASES, analyse, run_phases
from stagewise.compiler.compile.phases import plan as plan_phase
from stagewise.compiler.pipeline.pipeline import Pipeline
from stagewise.compiler.pipeline.readings import Compiled
from stagewise.compiler.pipeline.virtual_devices import virtual_layout
from stagewise.ir.choices import ActivationPolicy, CostModel, Schedule
from stagewise.ir.devices import format_bytes
from stagewise.ir.errors import CapacityError, ExampleInputsError, LossError, OptionError
from stagewise.ir.plan import Plan
from stagewise.ir.precision import LossScaling, check_precision
from stagewise.ir.topology import Topology
from stagewise.passes.capture import input_names
from stagewise.passes.costs import plan_charges
from stagewise.passes.shared import unheld_state
from stagewise.passes.sim_result import SimResult
from stagewise.passes.simulate import simulate as simulate_programs
from stagewise.passes.swap import SwapMode
from stagewise.runtime.stage_calls import Acceleration


@releasing_fx_sources
@given_once
def compile(  # noqa: A001 - the public name of the API
    model: torch.nn.Module,
    devices,
    example_inputs,
    *,
    loss_fn=None, example_target=None,
    loss_reduction=None,
    optimizer=None,
    plan: PlanOptions | None = None,
    memory: MemoryOptions | None = None,
    training: TrainingOptions | None = None,
    microbatches: int | None = None,
    schedule: Schedule | str = Schedule.AUTO,
    cost: CostModel | str = CostModel.PROFILE,
    split_points: list[str] | None = None,
    clip_grad_norm: float | None = None,
    swap: SwapMode | str = SwapMode.AUTO,
    replicas: int | str | tuple[int, ...] = 1,
    stages: int | str | None = None,
    optimizer_on_host: bool = False,
    activations: ActivationPolicy | str = ActivationPolicy.AUTO,
    seed: int | None = None,
    precision: str | LossScaling = "fp32",
    virtual_devices: int | None = None,
    asynchronous: bool = False,
    shape_buckets: int | tuple[int, ...] | list[int] | None = None,
    compile_stages: bool = False,
    cuda_graphs: bool = False,
    tensor_parallel: int = 1,
) -> Pipeline:
    """Compile `model` into a pipeline over `devices` that trains exactly like eager training.

    The planner simulates candidate plans and keeps the fastest that fits every device's memory,
    unless `plan` fixes the schedule, the microbatches or the cuts.

    Args:
        model: the torch.nn.Module to train (its weights are copied to the stages).
        devices: a count of CPU devices, or a list of ints, "cpu" / "cuda:1", torch.device, sw.Device.
        example_inputs: a tuple (or dict by name) of tensors, a batch of the largest shape steps
            will give: memory is planned for it; smaller batches and shorter sequences train too.
        loss_fn: (output, target) -> scalar loss, with `example_target` (a batch of targets);
            None where the model returns its own loss.
        loss_reduction: sw.TokenMean / sw.SampleMean, how the loss averages over the batch
            (default: a Hugging Face model's own token mean).
        optimizer: a factory params -> torch.optim.Optimizer (functools.partial(AdamW, lr=...)) or
            sw.ParamGroups; default SGD(lr=0.01).
        plan: sw.PlanOptions: microbatches, schedule, cost, split_points, replicas, stages,
            virtual_devices, asynchronous (documented there).
        memory: sw.MemoryOptions: swap, optimizer_on_host, activations.
        training: sw.TrainingOptions: clip_grad_norm, seed, precision, shape_buckets,
            compile_stages, cuda_graphs.
        microbatches ... cuda_graphs: each option of the three groups may instead be given as
            a keyword of its own (`microbatches=4`), the same value as in its group.
        tensor_parallel: the ranks each stage spans (Megatron's pairs split over them, the rest
            replicated); this version runs one device over all `torchrun --nproc-per-node T` ranks.

    Returns:
        The sw.Pipeline: `pipe.step(x, target=y)` trains one step and returns its loss.

    Raises:
        StagewiseError: a subclass naming what is wrong and the fix: OptionError for an option
            given both as a keyword and in its group, or of the wrong type; TraceError,
            CapacityError, BatchSizeError, PrecisionError, ...

    Example:
        >>> model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
        >>> x, y = torch.randn(8, 8), torch.randint(0, 4, (8,))
        >>> pipe = sw.compile(model, 2, (x,), loss_fn=torch.nn.functional.cross_entropy, example_target=y,
        ...                   plan=sw.PlanOptions(microbatches=2, schedule="1f1b", cost="analytic"),
        ...                   training=sw.TrainingOptions(clip_grad_norm=1.0, seed=0))
        >>> pipe.plan.microbatches
        2
        >>> loss = pipe.step(x, target=y)
    """
    chosen = with_groups(dict(microbatches=microbatches, schedule=schedule, cost=cost, split_points=split_points,
                              replicas=replicas, stages=stages, virtual_devices=virtual_devices,
                              asynchronous=asynchronous, swap=swap,
                              optimizer_on_host=optimizer_on_host, activations=activations,
                              clip_grad_norm=clip_grad_norm, seed=seed, precision=precision,
                              shape_buckets=shape_buckets, compile_stages=compile_stages,
                              cuda_graphs=cuda_graphs), plan, memory, training)
    if chosen["cost"] is None:  # PlanOptions' default: compile's own
        chosen["cost"] = CostModel.PROFILE
    virtual = chosen.pop("virtual_devices")
    buckets = parse_shape_buckets(chosen.pop("shape_buckets"))
    _check_arguments(model, chosen["split_points"], example_inputs, loss_fn, loss_reduction, buckets)
    loss_reduction = loss_reduction or model_reduction(model, input_names(model, example_inputs)[0], loss_fn)
    options = make_options(loss_fn=loss_fn, example_target=example_target, optimizer=optimizer,
                           bucketed=buckets is not None, tensor_parallel=tensor_parallel, **chosen)
    devices = virtual_layout(devices, virtual, options.tensor_parallel)  # after the options check T
    ctx = CompileContext(CompileRequest.make(model, devices, example_inputs, options))
    run_checked(ctx)
    chosen_plan = after(ctx.plan, "plan")
    graph = after(ctx.analysis, "capture")
    model_graph = describe_model(model, graph.at(chosen_plan.microbatches), graph.tracer, options, virtual)
    padding = None if buckets is None else bucket_padding(graph.capture, buckets, graph.inputs, graph.target,
                                                          loss_reduction)
    return pipeline_of(ctx, loss_reduction, model_graph, padding)


def pipeline_of(ctx: CompileContext, loss_reduction, model_graph: dict, padding: Padding | None = None) -> Pipeline:
    """The pipeline the phases made in `ctx`; `model_graph` what its checkpoints keep to plan again;
    `padding` how its steps' sequences are padded (shape_buckets)."""
    compiled = Compiled(after(ctx.choice, "plan").sim_cost, ctx.seconds, loss_reduction, model_graph, padding)
    described = after(ctx.plan, "plan")
    return Pipeline(described, after(ctx.runtime, "runtime"), compiled, unheld_state(ctx.request.model, described.stages))


@releasing_fx_sources
@given_once
def plan(
    model: torch.nn.Module,
    devices,
    example_inputs,
    *,
    loss_fn=None, example_target=None,
    optimizer=None,
    plan: PlanOptions | None = None,
    memory: MemoryOptions | None = None,
    training: TrainingOptions | None = None,
    microbatches: int | None = None,
    schedule: Schedule | str = Schedule.AUTO,
    split_points: list[str] | None = None,
    swap: SwapMode | str = SwapMode.AUTO,
    replicas: int | str | tuple[int, ...] = 1,
    stages: int | str | None = None,
    optimizer_on_host: bool = False,
    activations: ActivationPolicy | str = ActivationPolicy.AUTO,
    precision: str = "fp32",
    topology: Topology | None = None,
    asynchronous: bool = False,
) -> Plan:
    """The plan `compile` would choose, without a runtime, for devices this machine need not have.

    Every cost is modelled from the devices' figures, none timed here (passes/analytic.py,
    compiler/compile/modelled_costs.py), and the model may live on the meta device (no weights:
    `with torch.device("meta"): model = ...`).

    Args:
        model, devices, example_inputs, loss_fn, example_target, optimizer: as `compile`'s;
            devices are typically sw.Device("cuda", memory="80GiB", peak_flops="989TFLOPS", ...).
        plan: sw.PlanOptions, as compile's, with cost None or "analytic" and no virtual_devices.
        memory: sw.MemoryOptions, as compile's.
        training: sw.TrainingOptions, as compile's.
        microbatches ... precision: the groups' options as keywords of their own, as compile's.
        topology: sw.Topology, the links between the devices (default: PCIe between GPUs).

    Returns:
        The sw.Plan: `print(plan)` shows its stages; `sw.simulate(plan)` its predicted timeline.

    Raises:
        StagewiseError: as compile's; OptionError for cost="profile" or virtual_devices.

    Example:
        >>> model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
        >>> x, y = torch.randn(8, 8), torch.randint(0, 4, (8,))
        >>> gpu = sw.Device("cuda", memory="80GiB", peak_flops="989TFLOPS")
        >>> chosen = sw.plan(model, [gpu, gpu], (x,), loss_fn=torch.nn.functional.cross_entropy,
        ...                  example_target=y, plan=sw.PlanOptions(microbatches=4, schedule="gpipe"))
        >>> chosen.microbatches, len(chosen.devices)
        (4, 2)
    """
    chosen = with_groups(dict(microbatches=microbatches, schedule=schedule, split_points=split_points, swap=swap,
                              replicas=replicas, stages=stages, optimizer_on_host=optimizer_on_host,
                              asynchronous=asynchronous,
                              activations=activations, precision=precision, cost=CostModel.ANALYTIC, virtual_devices=None, clip_grad_norm=None,
                              seed=0), plan, memory, training)
    chosen.pop("shape_buckets", None)  # how steps are padded: nothing a plan holds
    if chosen.pop("virtual_devices") is not None:
        raise OptionError("virtual_devices= places a plan on this process's devices: give it to sw.compile; "
                          "sw.plan plans for the devices given")
    if chosen["cost"] is None:  # PlanOptions' default: the only one sw.plan has
        chosen["cost"] = CostModel.ANALYTIC
    if chosen["seed"] is None:  # TrainingOptions' default: the plan records one
        chosen["seed"] = 0
    _check_arguments(model, chosen["split_points"], example_inputs, loss_fn, None)
    options = make_options(loss_fn=loss_fn, example_target=example_target, optimizer=optimizer,
                           topology=topology, **chosen)
    return planned(CompileRequest.make(model, devices, example_inputs, options, runs_here=False))[0]


def planned(request: CompileRequest, analysis: Analysis | None = None) -> tuple[Plan, Analysis]:
    """The phases from capture to plan for `request`, and the capture they used: a search over many
    device sets (sw.recommend) hands one capture back in when the first microbatch count agrees."""
    ctx = CompileContext(request)
    phases = PHASES[:PHASES.index(plan_phase) + 1]
    if analysis is not None and analysis.first_microbatches == request.first_microbatches:
        ctx.analysis, phases = analysis, phases[1:]
    run_checked(ctx, phases)
    return after(ctx.plan, "plan"), after(ctx.analysis, "capture")


def simulate(plan: Plan, peak_flops: float | None = None, bandwidth: float | None = None) -> SimResult:
    """The predicted timeline of one iteration of `plan`, as the planner simulated it.

    Args:
        plan: a sw.Plan (from sw.plan, `pipe.plan`, or a checkpoint's).
        peak_flops: predict for devices of this many FLOP/s instead (the analytic model's bound).
        bandwidth: predict for links of this many bytes/s instead.

    Returns:
        The SimResult: `iteration_time` in seconds, `to_chrome_trace(path)`, `to_png(path)`.

    Raises:
        OptionError: `plan` is not a Plan.
        PlanError: the plan records no costs (saved before plans kept them).
        DeviceError: a `bandwidth` that is not a positive number.

    Example:
        >>> model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
        >>> x, y = torch.randn(8, 8), torch.randint(0, 4, (8,))
        >>> gpu = sw.Device("cuda", memory="80GiB", peak_flops="989TFLOPS")
        >>> chosen = sw.plan(model, [gpu, gpu], (x,), loss_fn=torch.nn.functional.cross_entropy,
        ...                  example_target=y, microbatches=2)
        >>> sw.simulate(chosen).iteration_time > sw.simulate(chosen, peak_flops=1e20).iteration_time
        True
    """
    if not isinstance(plan, Plan):
        raise OptionError(f"sw.simulate takes a Plan (what sw.plan returns, or pipe.plan), got {type(plan).__name__}")
    return simulate_programs(plan.programs, plan_charges(plan, peak_flops, bandwidth))


def make_options(*, optimizer, split_points, precision, compile_stages=False, cuda_graphs=False, bucketed=False,
                 **given) -> CompileOptions:
    """CompileOptions from the public keyword arguments (defaults and conversions applied; `bucketed`:
    compile's shape_buckets given)."""
    return CompileOptions(optimizer=DEFAULT_OPTIMIZER if optimizer is None else optimizer,
                          split_points=None if split_points is None else tuple(split_points),
                          precision=check_precision(precision),
                          loss_scaling=precision if isinstance(precision, LossScaling) else None,
                          acceleration=Acceleration(compile_stages, cuda_graphs, bucketed), **given)


def _check_arguments(model: object, split_points: object, example_inputs, loss_fn: object, reduction: object,
                     buckets: ShapeBuckets | None = None) -> None:
    """What CompileOptions cannot check: a module to compile, split points as a list of names (a
    string would be read as one name per character), a loss reduction whose labels can be read,
    buckets that fit the example's sequence (before the phases run, not after a long compile)."""
    if not isinstance(model, torch.nn.Module):
        raise ExampleInputsError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    check_split_points(split_points)
    if reduction is not None:
        check_loss_reduction(reduction, loss_fn is not None, input_names(model, example_inputs)[0])
    if buckets is not None:
        first = input_names(model, example_inputs)[0][0]
        sequence_length(buckets, first, example_inputs[first] if isinstance(example_inputs, dict) else example_inputs[0])


def run_checked(ctx: CompileContext, phases=PHASES) -> None:
    """The compile phases, with the checks that need a phase's result run right after it."""
    checks = {analyse: lambda: _check_loss_is_differentiable(ctx.request.model, after(ctx.first, "analyse").graph),
              plan_phase: lambda: _check_layers_fit(after(ctx.plan, "plan"))}
    for phase in phases:
        run_phases(ctx, (phase,))
        if phase in checks:
            checks[phase]()


_DETACHING = {("call_method", "detach"), ("call_function", torch.detach), ("call_function", torch.Tensor.detach),
              ("call_function", torch.ops.aten.detach.default)}


def _check_loss_is_differentiable(model: torch.nn.Module, graph: fx.GraphModule) -> None:
    """The loss depends on a trainable parameter other than through a detach: else backward has
    nothing to differentiate, and the step would fail deep in the runtime."""
    if not any(p.requires_grad for p in model.parameters()):
        return
    output = next(n for n in graph.graph.nodes if n.op == "output")
    seen: set[fx.Node] = set()
    frontier = list(output.all_input_nodes)
    while frontier:
        node = frontier.pop()
        if node in seen or (node.op, node.target) in _DETACHING:
            continue
        seen.add(node)
        if _holds_trainable_parameter(graph, node):
            return
        frontier.extend(node.all_input_nodes)
    raise LossError("the loss does not depend on any trainable parameter (is it detached, or computed under "
                    "torch.no_grad?); return the loss with its autograd graph: drop .detach() / .item() / no_grad "
                    "from the model's forward and loss_fn")


def _holds_trainable_parameter(graph: fx.GraphModule, node: fx.Node) -> bool:
    if node.op == "call_module":
        return any(p.requires_grad for p in graph.get_submodule(str(node.target)).parameters())
    if node.op == "get_attr":
        try:
            value = graph.get_parameter(str(node.target))
        except AttributeError:
            return False
        return value.requires_grad
    return False


def _check_layers_fit(chosen: Plan) -> None:
    """Each device's memory holds the weights of the largest layer its stages run: no schedule or
    swap can run a layer whose weights do not fit (the pool would refuse it at the first step)."""
    for stage in chosen.stages:
        capacity = chosen.devices[stage.device].memory
        if capacity is None or not stage.layers:
            continue
        largest = max((chosen.layers[i] for i in stage.layers), key=lambda layer: layer.param_bytes)
        if largest.param_bytes > capacity:
            raise CapacityError(
                f"device {stage.device} ({chosen.devices[stage.device].name}, memory={format_bytes(capacity)}) "
                f"cannot hold layer {largest.name!r}: its weights alone take {format_bytes(largest.param_bytes)}; "
                "give the device more memory (or memory=None for no limit), or cut the model finer")
