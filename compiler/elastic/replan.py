"""`sw.load(directory, devices=...)` on other devices: the saved graph planned again (Varuna §4.5).

The checkpoint's graph.json (compiler/compile/model_graph.py) becomes a stand-in for the model, which the
compile phases after capture plan for the new devices as they would the model: profiled (or
analytic) costs, the planner's search over schedules, depths and replicas, code generation. The
state then comes from the checkpoint, each process reading only its own stages' names
(compiler/checkpoint/restore.py), and what moved is printed as `pipe.restore` prints it.

The saved graph is the one the saved stages ran, at the saved microbatch size, and the stage
code takes what that size's code took: smaller microbatches and shorter sequences down to the
saved plan's lowest sizes. An fx graph computes its sizes at any size, so the planner may choose
any microbatch count; a torch.export graph's symbolic sizes were checked only over the sizes the
saved plan's steps may take (its guards are not kept), so its plan keeps to microbatches of those
sizes: from the saved plan's smallest to its microbatch size (more microbatches, not fewer). The
global batch is the saved one either way; a microbatch count the user fixed stays.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from dataclasses import replace
from types import MappingProxyType

import torch
import torch.fx as fx

from stagewise.compiler.assembly.loss_reduction import reduction_from_data
from stagewise.compiler.assembly.optimizer_recipe import recorded_optimizer
from stagewise.compiler.assembly.options import CompileOptions, CompileRequest
from stagewise.compiler.assembly.shape_buckets import padding_from_data
from stagewise.compiler.checkpoint.read import Checkpoint
from stagewise.compiler.checkpoint.write import GRAPH_FILE
from stagewise.compiler.compile import driver
from stagewise.compiler.compile.analysis import Analysis
from stagewise.compiler.compile.context import CompileContext
from stagewise.compiler.compile.model_graph import stand_in, usable
from stagewise.compiler.pipeline.morph import restore_checkpoint
from stagewise.compiler.pipeline.pipeline import Pipeline
from stagewise.compiler.pipeline.training_state import put_saved_mode
from stagewise.ir.choices import ActivationPolicy, CostModel, Schedule
from stagewise.ir.declared import ALTERED, dtype_named
from stagewise.ir.errors import CapacityError, CheckpointError, PlanError, StagewiseError
from stagewise.ir.plan import InputSpec, Plan
from stagewise.ir.precision import LossScaling
from stagewise.passes.capture import Capture, Objective
from stagewise.passes.swap import SwapMode
from stagewise.runtime.stage_calls import Acceleration


def replan(saved: Checkpoint, graph: fx.GraphModule | None, devices, trusted: Mapping[str, Callable],
           report: bool, tensor_parallel: int = 1) -> Pipeline:
    """A pipeline planned for `devices` from `saved`'s graph (`graph`: graph.json rebuilt on the meta
    device, compiler/checkpoint/verify.py), each stage over `tensor_parallel` ranks, holding its state;
    trains on from it. `trusted`: the caller's functions by name."""
    model_graph, rebuilt = usable(saved.model_graph, graph, saved.root)
    model = stand_in(model_graph, saved, rebuilt)
    plan, training = saved.plan, saved.training
    inputs, target = _example_batch(plan)
    options = replace(_options(model_graph, plan, training, target, trusted, saved.root / GRAPH_FILE),
                      tensor_parallel=tensor_parallel)
    request = CompileRequest.make(model, devices, inputs, options)
    request = replace(request, input_names=plan.input_names, input_kind=plan.input_kind)
    captured = SavedGraph(model, plan, str(model_graph.get("tracer", "fx")))
    ctx = CompileContext(request)
    ctx.analysis = Analysis(model, inputs, target, options.loss_fn, request.batch, request.first_microbatches,
                            dynamic=options.dynamic, precision=options.precision, captured=captured)
    try:
        driver.run_checked(ctx, driver.PHASES[1:])
    except CapacityError as error:
        raise CapacityError(f"{error}\n(planning {saved.root} again: the options are the saved ones; to plan with "
                            "others, such as more microbatches, compile the model with them and call "
                            "pipe.restore(directory))") from None
    pipe = driver.pipeline_of(ctx, reduction_from_data(training.get("loss_reduction")), model_graph,
                              padding_from_data(training.get("padding")))
    restore_checkpoint(pipe, saved, report, training_state=True, constants=True)
    put_saved_mode(pipe, training)
    return pipe


class SavedGraph(Capture):
    """The saved graph as the capture: at each size its values come from fake-tensor propagation
    (its code reads its sizes from its inputs), and the sizes a step may give are the saved plan's."""

    def __init__(self, model: fx.GraphModule, saved: Plan, tracer: str):
        keyword = saved.input_kind == "keyword"
        super().__init__(Objective(model, None, keyword), tracer, list(saved.input_names), saved.input_kind,
                         saved.target_name, model, None)
        self.saved = saved

    def _graph_at(self, inputs, target) -> fx.GraphModule:
        return self.propagated(inputs, target)

    def model_output(self, gm: fx.GraphModule) -> tuple[str | None, tuple[str | None, ...]]:
        """The saved plan's: the saved graph keeps its node names."""
        return self.saved.output_spec, self.saved.output_nodes

    def lowest_sizes(self) -> list[tuple[int, ...]] | None:
        return None if self.tracer == "fx" else [spec.lowest or spec.shape for spec in self.saved.input_specs]

    def smallest_microbatch(self, inputs, target, planned: int) -> int:
        return 1 if self.tracer == "fx" else self.saved.smallest_microbatch


def loss_in_saved_graph(output, target):
    """Stands for the loss function of a re-planned pipeline: the saved graph computes the loss
    itself, so planning never calls it."""
    raise PlanError("the loss of a re-planned pipeline is computed by its saved graph, not by a loss function")


def _options(model_graph: dict, plan: Plan, training: dict, target: torch.Tensor | None,
             trusted: Mapping[str, Callable] = MappingProxyType({}), where: object = GRAPH_FILE) -> CompileOptions:
    """compile's options for the new plan: the saved ones (compiler/compile/model_graph.py, read from `where`),
    the checkpoint's optimizer, clipping and seed; an export graph's microbatch sizes (module docstring)."""
    saved = model_graph.get("options", {})  # a table: checkpoint_limits.check_model_graph
    sizes = None
    if model_graph.get("tracer") != "fx":
        sizes = (plan.smallest_microbatch or plan.microbatch_size, plan.microbatch_size)
    return CompileOptions(
        loss_fn=None if target is None else loss_in_saved_graph, example_target=target,
        optimizer=recorded_optimizer(training.get("optimizer"), training.get("optimizer_groups", []),
                                     plan.aliases, trusted),
        microbatches=saved.get("microbatches"), microbatch_sizes=sizes, schedule=saved.get("schedule", Schedule.AUTO),
        cost=saved.get("cost", CostModel.PROFILE),
        clip_grad_norm=training.get("clip_grad_norm"), swap=saved.get("swap", SwapMode.AUTO),
        replicas=saved.get("replicas", 1), stages=saved.get("stages"),
        optimizer_on_host=bool(saved.get("optimizer_on_host", False)), asynchronous=saved.get("asynchronous") is True,
        activations=saved.get("activations", ActivationPolicy.AUTO), seed=plan.seed, precision=plan.precision,
        loss_scaling=_loss_scaling(saved.get("loss_scaling"), where), acceleration=_replanned(training))


def _replanned(training: dict) -> Acceleration:
    """The saved stage acceleration a new plan keeps: compile_stages (checked again by the phases), not
    cuda_graphs: whether a graph may replay depends on the new plan's swaps, so it is dropped, said."""
    saved = Acceleration(**training.get("acceleration") or {})  # checked: compiler/checkpoint/training_file.py
    if saved.cuda_graphs:
        warnings.warn("the checkpoint's stages replayed CUDA graphs; a pipeline planned again for other devices "
                      "runs them eagerly: compile the model with cuda_graphs=True for these devices and call "
                      "pipe.restore(directory)", stacklevel=5)
    return Acceleration(compile_stages=saved.compile_stages, bucketed=saved.bucketed)


def _loss_scaling(saved: object, where: object) -> LossScaling | None:
    """graph.json's loss scaling (None: none), its fields LossScaling's and checked by it."""
    if saved is None:
        return None
    try:
        return LossScaling(**saved)  # type: ignore[arg-type]  # a non-mapping is refused below
    except (TypeError, StagewiseError) as error:
        raise CheckpointError(f"{where} gives the loss scaling {repr(saved)[:120]} ({error}); {ALTERED}") from None


def _example_batch(plan: Plan) -> tuple[tuple | dict, torch.Tensor | None]:
    """A batch of the saved example's shapes and dtypes (what memory was planned for): random
    floats, integer ids 0, masks True. Only the profiler runs it."""
    batch = plan.microbatches * plan.microbatch_size
    generator = torch.Generator().manual_seed(0)  # the user's random stream stays as it was
    tensors = [_example_tensor(spec, batch, generator) for spec in plan.input_specs]
    inputs, target = tensors[:len(plan.input_names)], None
    if plan.target_name is not None and len(tensors) > len(plan.input_names):
        target = tensors[len(plan.input_names)]
    if plan.input_kind == "keyword":
        return dict(zip(plan.input_names, inputs, strict=True)), target
    return tuple(inputs), target


def _example_tensor(spec: InputSpec, batch: int, generator: torch.Generator) -> torch.Tensor:
    dtype = dtype_named(spec.dtype, "plan.json (an input's spec)")
    shape = (batch, *spec.shape) if spec.batched else spec.shape
    if dtype.is_floating_point:
        return torch.randn(shape, dtype=dtype, generator=generator)
    return torch.ones(shape, dtype=dtype) if dtype == torch.bool else torch.zeros(shape, dtype=dtype)
