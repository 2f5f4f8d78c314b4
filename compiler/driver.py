"""`stagewise.compile`: trace -> layers -> cut-points -> partition -> shared -> schedule -> lower -> codegen."""

from __future__ import annotations

import functools

import torch
from stagewise.codegen.stages import build_stage_modules
from stagewise.compiler.devices import resolve_devices
from stagewise.compiler.errors import BatchSizeError, ExampleInputsError, PartitionError, PlanError
from stagewise.compiler.ir import Plan
from stagewise.compiler.pipeline import Pipeline
from stagewise.compiler.trace import input_names, trace
from stagewise.passes.cutpoints import find_cuts
from stagewise.passes.layers import build_layers
from stagewise.passes.layout import STATE_PER_PARAM_BYTE, choose_layout
from stagewise.passes.lower import lower
from stagewise.passes.partition import balanced_starts, starts_from_split_points
from stagewise.passes.replicate import replicate
from stagewise.passes.schedule import SCHEDULES, instance_tasks
from stagewise.passes.shared import alias_groups, find_shared
from stagewise.passes.stages import build_stages
from stagewise.passes.swap import plan_swaps

DEFAULT_OPTIMIZER = functools.partial(torch.optim.SGD, lr=0.01)


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
    replicas: int = 1,
) -> Pipeline:
    """Compile `model` into a pipeline over `devices` that trains exactly like eager training.

    `swap`: "auto" swaps state to host memory only where a device's capacity requires it,
    "on" forces Harmony-style swapping, "per-device" the per-GPU baseline, "off" never.
    `replicas`: data-parallel copies of the pipeline (P x D with P = devices / replicas).
    """
    if not isinstance(model, torch.nn.Module):
        raise ExampleInputsError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    resolved = resolve_devices(devices)
    names, kind = input_names(model, example_inputs)
    batch = batch_size(example_inputs, example_target)
    if microbatches is None:
        microbatches = max(d for d in range(1, len(resolved) + 1) if batch % d == 0)
    check_microbatches(batch, microbatches)
    size = batch // microbatches
    traced = trace(model, split_batch(example_inputs, microbatches)[0], _first(example_target, microbatches), loss_fn)
    gm = traced.graph_module

    layers = build_layers(gm, model)
    cuts = find_cuts(gm, layers, size)
    schedule = "gpipe" if schedule == "auto" else schedule
    if schedule not in SCHEDULES:
        raise PlanError(f"unknown schedule {schedule!r}; choose one of {', '.join(SCHEDULES)}")
    capacities = [d.memory for d in resolved]
    layout = choose_layout(schedule, len(resolved), replicas, sum(c.legal for c in cuts),
                           sum(layer.param_bytes for layer in layers), min((c for c in capacities if c), default=None))
    n_stages = layout.positions
    if split_points is not None:
        starts = starts_from_split_points(layers, cuts, list(split_points))
        if len(starts) != n_stages:
            raise PartitionError(
                f"split_points gives {len(starts)} stages but {len(resolved)} devices with schedule "
                f"{schedule!r} need {n_stages}; give {n_stages - 1} split points"
            )
    else:
        starts = balanced_starts(layers, cuts, n_stages)
    stages, transfers = build_stages(gm, layers, starts, size, len(resolved))
    stages, transfers = replicate(stages, transfers, layout.replicas, microbatches, layout.device_of)
    shared = find_shared(gm, stages)
    swaps = plan_swaps(swap, stages, layers, capacities, STATE_PER_PARAM_BYTE)
    if swaps.stages and clip_grad_norm is not None:
        raise PlanError(
            "clip_grad_norm with swapping is not supported yet: the global norm needs every gradient at once. "
            "Give the devices more memory, or clip inside the optimizer"
        )
    jit_update = clip_grad_norm is None
    tasks = instance_tasks(schedule, stages, microbatches, len(resolved), jit_update)
    programs = lower(stages, transfers, shared, tasks, clip_grad_norm is not None, swaps)
    plan = Plan(
        model=type(model).__name__,
        tracer=traced.tracer,
        devices=tuple(d.spec() for d in resolved),
        input_names=tuple(names),
        input_kind=kind,
        target_name=traced.target_name,
        graph_inputs=traced.graph_inputs,
        microbatches=microbatches,
        microbatch_size=size,
        schedule=schedule,
        layers=layers,
        cuts=cuts,
        shared=shared,
        stages=stages,
        transfers=transfers,
        programs=programs,
        state_names=tuple(model.state_dict().keys()),
        aliases=tuple(alias_groups(gm)),
    )
    modules = build_stage_modules(gm, layers, stages)
    return Pipeline(plan, modules, optimizer or DEFAULT_OPTIMIZER, clip_grad_norm, swaps.stages)


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
