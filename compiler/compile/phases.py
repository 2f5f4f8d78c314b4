"""`compile()` in named phases: capture -> analyse -> cost -> plan -> codegen -> runtime.

Each phase takes the one `CompileContext`, reads what the phases before it left there and adds
its own result, so each can be run and looked at alone (tests/test_phases.py). `run_phases`
runs them in order and times each.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

from stagewise.codegen.stages import build_stage_modules
from stagewise.codegen.tensor_parallel import shard_stage
from stagewise.compiler.assembly.runtime_setup import start_runtime
from stagewise.compiler.assembly.stage_acceleration import check_plan as check_acceleration
from stagewise.compiler.assembly.tensor_parallel import rank0_state, tensor_parallel_position
from stagewise.compiler.compile.analysis import Analysed, Analysis
from stagewise.compiler.compile.context import CompileContext, after
from stagewise.compiler.compile.costing import measure_costs
from stagewise.compiler.compile.planning import choose_plan
from stagewise.ir.plan import Plan
from stagewise.ir.tensor_parallel import TensorParallel
from stagewise.passes.megatron import find_blocks
from stagewise.passes.planner import recorded_costs
from stagewise.passes.random_ops import key_random_ops
from stagewise.passes.shared import alias_groups


def capture(ctx: CompileContext) -> None:
    """Trace (fx) or export the model with its loss, once: `ctx.analysis`."""
    request, options = ctx.request, ctx.request.options
    ctx.analysis = Analysis(request.model, request.example_inputs, options.example_target, options.loss_fn,
                            request.batch, request.first_microbatches, dynamic=options.dynamic,
                            precision=options.precision)


def analyse(ctx: CompileContext) -> None:
    """The graph at the first microbatch count, its layers and cut-points: `ctx.first`."""
    ctx.first = after(ctx.analysis, "capture").first


def cost(ctx: CompileContext) -> None:
    """Per-layer costs (profiled or analytic), the links between the devices and what the runtime adds: `ctx.costs`."""
    after(ctx.first, "analyse")
    ctx.costs = measure_costs(ctx.request, after(ctx.analysis, "capture"))


def plan(ctx: CompileContext) -> None:
    """Partition, schedule, lower and simulate candidates, keep one (`ctx.choice`), and describe it
    as the IR (`ctx.plan`)."""
    analysis = after(ctx.analysis, "capture")
    ctx.choice = choose_plan(ctx.request, analysis, after(ctx.costs, "cost"))
    chosen, prediction = ctx.choice.plan, ctx.choice.prediction
    graph = analysis.at(chosen.microbatches)
    request, costs = ctx.request, after(ctx.costs, "cost")
    state = request.model.state_dict(keep_vars=True)  # every key, unused layers' and every alias's
    output_spec, output_nodes = analysis.capture.model_output(graph.graph)
    ctx.plan = Plan(
        model=type(request.model).__name__,
        tracer=analysis.tracer,
        devices=tuple(request.specs),
        input_names=request.input_names,
        input_kind=request.input_kind,
        target_name=analysis.target_name,
        input_specs=analysis.input_specs(request.input_specs),
        smallest_microbatch=analysis.smallest_microbatch(graph.microbatch_size),
        seed=request.seed,
        training=request.model.training,
        precision=request.options.precision,
        output_spec=output_spec,
        output_nodes=output_nodes,
        graph_inputs=graph.graph_inputs,
        microbatches=chosen.microbatches,
        microbatch_size=graph.microbatch_size,
        schedule=chosen.schedule,
        layers=graph.layers,
        cuts=graph.cuts,
        shared=chosen.shared,
        stages=chosen.stages,
        transfers=chosen.transfers,
        programs=chosen.programs,
        state_names=tuple(state),
        aliases=tuple(alias_groups(request.model)),
        state_shapes=tuple(tuple(v.shape) if isinstance(v, torch.Tensor) else () for v in state.values()),
        cost_model=request.options.cost,
        predicted_iteration_s=prediction.iteration_s,
        predicted_stage_s=prediction.stage_s,
        predicted_peak_bytes=prediction.peak_bytes,
        predicted_host_bytes=chosen.host_bytes,
        predicted_split=prediction.split,
        considered=ctx.choice.considered,
        costs=recorded_costs(chosen, costs.layers.at(graph.microbatch_size), costs.topology, costs.runtime),
        tensor_parallel=_tensor_parallel(graph, request.options.tensor_parallel),
    )


def _tensor_parallel(graph: Analysed, degree: int) -> TensorParallel | None:
    """Megatron's pairs of the graph split over `degree` ranks (passes/megatron.py); None for one rank."""
    return find_blocks(graph.graph, graph.layers, degree) if degree > 1 else None


def codegen(ctx: CompileContext) -> None:
    """One Python module per stage, cut from the graph at the plan's microbatch size, its random ops
    drawing from keyed streams (passes/random_ops.py): `ctx.modules`."""
    chosen = after(ctx.choice, "plan").plan
    graph = after(ctx.analysis, "capture").at(chosen.microbatches)
    modules = build_stage_modules(key_random_ops(graph.graph), graph.layers, chosen.stages)
    parallel = after(ctx.plan, "plan").tensor_parallel
    if parallel is not None:  # this rank's part of each stage, the collectives in its code
        position = tensor_parallel_position(parallel.degree, len(after(ctx.plan, "plan").devices))
        rank0_state(modules)
        modules = [shard_stage(module, parallel, position) for module in modules]
    ctx.modules = modules


def runtime(ctx: CompileContext) -> None:
    """Memory pools, transport, stage workers and executor for this process: `ctx.runtime`."""
    options = ctx.request.options
    chosen, modules = after(ctx.plan, "plan"), after(ctx.modules, "codegen")
    check_acceleration(options.acceleration, chosen, modules)
    ctx.runtime = start_runtime(chosen, modules, options.optimizer, options.clip_grad_norm,
                                after(ctx.choice, "plan").plan.swaps.stages, options.loss_scaling, options.acceleration)


PHASES: tuple[Callable[[CompileContext], None], ...] = (capture, analyse, cost, plan, codegen, runtime)


def run_phases(ctx: CompileContext, phases: Sequence[Callable[[CompileContext], None]] = PHASES) -> None:
    """Run `phases` in order, recording the seconds each took in `ctx.seconds`. The global random
    generators are left as they were: calibration and probes draw a number of samples that depends
    on timing, and would shift the user's stream (the data drawn after compile) from run to run."""
    present = torch.cuda.is_available()  # sw.plan plans for GPUs this machine need not have
    cuda = sorted({d.torch_device.index or 0 for d in ctx.request.devices if d.torch_device.type == "cuda" and present})
    with torch.random.fork_rng(devices=cuda):
        for phase in phases:
            start = time.perf_counter()
            phase(ctx)
            ctx.seconds[phase.__name__] = time.perf_counter() - start
