"""`stagewise.compile`: check the arguments, then run the compile phases (compiler/compile/phases.py):
capture -> analyse -> cost -> plan -> codegen -> runtime."""

from __future__ import annotations

import torch
import torch.fx as fx

from stagewise.compiler.assembly.fx_sources import releasing_fx_sources
from stagewise.compiler.assembly.loss_reduction import check_loss_reduction, model_reduction
from stagewise.compiler.assembly.options import DEFAULT_OPTIMIZER, CompileOptions, CompileRequest
from stagewise.compiler.compile.analysis import Analysis
from stagewise.compiler.compile.context import CompileContext, after
from stagewise.compiler.compile.model_graph import describe_model
from stagewise.compiler.compile.phases import PHASES, analyse, run_phases
from stagewise.compiler.compile.phases import plan as plan_phase
from stagewise.compiler.pipeline.pipeline import Compiled, Pipeline
from stagewise.compiler.pipeline.virtual_devices import virtual_layout
from stagewise.ir.choices import CostModel, Schedule
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


@releasing_fx_sources
def compile(  # noqa: A001 - the public name of the API
    model: torch.nn.Module,
    devices,
    example_inputs,
    *,
    loss_fn=None, example_target=None,
    loss_reduction=None,
    optimizer=None,
    microbatches: int | None = None,
    schedule: Schedule | str = Schedule.AUTO,
    cost: CostModel | str = CostModel.PROFILE,
    split_points: list[str] | None = None,
    clip_grad_norm: float | None = None,
    swap: SwapMode | str = SwapMode.AUTO,
    replicas: int | str | tuple[int, ...] = 1,
    stages: int | str | None = None,
    optimizer_on_host: bool = False,
    seed: int | None = None,
    precision: str | LossScaling = "fp32",
    virtual_devices: int | None = None,
) -> Pipeline:
    """Compile `model` into a pipeline over `devices` that trains exactly like eager training.

    `example_inputs` (and `example_target`) are a batch of the largest shape steps will give: memory is
    planned for it; smaller batches (uneven microbatches), shorter sequences and smaller images train
    on the same pipeline. With `schedule="auto"` and `microbatches=None` the planner simulates
    candidate plans and keeps the fastest that fits every device's memory. `cost`: "profile"
    measures each layer on this machine (cached on disk), "analytic" derives times from FLOPs and
    the devices' peak rates. `swap`: "auto" swaps state (weights, gradients, optimizer state) to host
    memory only where a device's capacity requires it, "on" forces Harmony-style swapping of state,
    "per-device" the per-GPU baseline, "off" never swaps anything; stashed activations go to host
    memory between forward and backward where a device cannot hold them (every mode but "off");
    "all" is "on" plus every stage's stashes (Harmony's sX). `replicas`: data-parallel copies of the
    pipeline (P x D); "auto" simulates every D that divides the devices and the microbatch count
    (Varuna §4.4); a tuple replicates each stage its own number of ways (PipeDream §2.4.1), and
    "per-stage" lets PipeDream's DP choose. `stages`: the depth P of a gpipe / 1f1b / varuna
    pipeline (default N / D); "auto" simulates every depth from 1. `loss_reduction`: sw.TokenMean /
    sw.SampleMean (README; default: a Hugging Face model's own token mean). `optimizer_on_host`: the
    optimizer steps fp32 masters in host memory (Harmony's CPU update, ZeRO-Offload), so no device
    holds optimizer state. `seed`: random ops draw from streams keyed by (seed, step, op, microbatch);
    None takes `torch.initial_seed()`. `precision`: "fp32", "bf16" (stage forwards under
    torch.autocast, fp32 weights, gradients, optimizer state and reductions) or "fp16" (the same
    with dynamic loss scaling, sw.LossScaling: a step whose gradients overflow on any stage is
    skipped on every stage, as is one with an inf or NaN under `clip_grad_norm`: SkippedUpdateWarning).
    `virtual_devices`: plan for that many devices placed on `devices` in proportion to their speed,
    bitwise the same training on any count (`pipe.resize`, compiler/pipeline/virtual_devices.py). README: the rest.
    """
    _check_arguments(model, split_points, example_inputs, loss_fn, loss_reduction)
    loss_reduction = loss_reduction or model_reduction(model, input_names(model, example_inputs)[0], loss_fn)
    devices = virtual_layout(devices, virtual_devices)
    options = make_options(loss_fn=loss_fn, example_target=example_target, optimizer=optimizer,
                           microbatches=microbatches, schedule=schedule, cost=cost, split_points=split_points,
                           clip_grad_norm=clip_grad_norm, swap=swap, replicas=replicas, stages=stages,
                           optimizer_on_host=optimizer_on_host, seed=seed, precision=precision)
    ctx = CompileContext(CompileRequest.make(model, devices, example_inputs, options))
    run_checked(ctx)
    chosen = after(ctx.plan, "plan")
    graph = after(ctx.analysis, "capture")
    model_graph = describe_model(model, graph.at(chosen.microbatches), graph.tracer, options, virtual_devices)
    return pipeline_of(ctx, loss_reduction, model_graph)


def pipeline_of(ctx: CompileContext, loss_reduction, model_graph: dict) -> Pipeline:
    """The pipeline the phases made in `ctx`; `model_graph` what its checkpoints keep to plan again."""
    compiled = Compiled(after(ctx.choice, "plan").sim_cost, ctx.seconds, loss_reduction, model_graph)
    described = after(ctx.plan, "plan")
    return Pipeline(described, after(ctx.runtime, "runtime"), compiled, unheld_state(ctx.request.model, described.stages))


@releasing_fx_sources
def plan(
    model: torch.nn.Module,
    devices,
    example_inputs,
    *,
    loss_fn=None, example_target=None,
    optimizer=None,
    microbatches: int | None = None,
    schedule: Schedule | str = Schedule.AUTO,
    split_points: list[str] | None = None,
    swap: SwapMode | str = SwapMode.AUTO,
    replicas: int | str | tuple[int, ...] = 1,
    stages: int | str | None = None,
    optimizer_on_host: bool = False,
    precision: str = "fp32",
    topology: Topology | None = None,
) -> Plan:
    """The plan `compile` would choose, without a runtime: for devices this machine need not have
    (`sw.Device("cuda", memory="80GiB", peak_flops="989TFLOPS", ...)`) and a model that may live on
    the meta device (no weights: `with torch.device("meta"): model = ...`). Every cost is modelled
    from the devices' figures, none timed here (passes/analytic.py, compiler/compile/modelled_costs.py);
    `topology` gives the links between the devices (default: PCIe between GPUs). The arguments
    are `compile`'s; `sw.simulate(plan)` gives its predicted timeline.
    """
    _check_arguments(model, split_points, example_inputs, loss_fn, None)
    options = make_options(loss_fn=loss_fn, example_target=example_target, optimizer=optimizer,
                           microbatches=microbatches, schedule=schedule, cost=CostModel.ANALYTIC, split_points=split_points,
                           clip_grad_norm=None, swap=swap, replicas=replicas, stages=stages,
                           optimizer_on_host=optimizer_on_host, seed=0, precision=precision, topology=topology)
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
    """The predicted timeline of one iteration of `plan` (`to_chrome_trace`, `to_png`), with the costs
    its prediction charged, or for devices of `peak_flops` FLOP/s and links of `bandwidth` bytes/s."""
    return simulate_programs(plan.programs, plan_charges(plan, peak_flops, bandwidth))


def make_options(*, optimizer, split_points, precision, **given) -> CompileOptions:
    """CompileOptions from the public keyword arguments (defaults and conversions applied)."""
    return CompileOptions(optimizer=DEFAULT_OPTIMIZER if optimizer is None else optimizer,
                          split_points=None if split_points is None else tuple(split_points),
                          precision=check_precision(precision),
                          loss_scaling=precision if isinstance(precision, LossScaling) else None, **given)


def _check_arguments(model: object, split_points: object, example_inputs, loss_fn: object, reduction: object) -> None:
    """What CompileOptions cannot check: a module to compile, split points as a list of names (a
    string would be read as one name per character), a loss reduction whose labels can be read
    (before the phases run, not after a long compile)."""
    if not isinstance(model, torch.nn.Module):
        raise ExampleInputsError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if split_points is not None and not isinstance(split_points, list | tuple):
        example = [split_points] if isinstance(split_points, str) else ["blocks.2"]
        raise OptionError(f"split_points={split_points!r} must be a list of layer names, e.g. split_points={example!r}")
    if reduction is not None:
        check_loss_reduction(reduction, loss_fn is not None, input_names(model, example_inputs)[0])


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
