"""`sw.PlanOptions`, `sw.MemoryOptions`, `sw.TrainingOptions`: compile's and plan's options in three
groups, each checked when made so a bad value fails where it is written, not inside a compile.

The flat keywords (`microbatches=4`) keep working; `given_once` refuses an option given both ways,
and `with_groups` puts each group's fields in place of the flat ones."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any, ParamSpec, TypeVar

from stagewise.compiler.assembly.options import (
    check_activations,
    check_clip_grad_norm,
    check_flags,
    check_microbatch_count,
    check_replicas_and_stages,
    check_seed,
    check_split_points,
)
from stagewise.compiler.assembly.shape_buckets import parse_shape_buckets
from stagewise.ir.choices import ActivationPolicy, CostModel, Schedule, parse_choice
from stagewise.ir.errors import OptionError
from stagewise.ir.precision import LossScaling, check_precision
from stagewise.passes.swap import SwapMode


@dataclass(frozen=True)
class PlanOptions:
    """How the model is cut into stages and scheduled.

    Args:
        microbatches: microbatches per step; None lets the planner choose.
        schedule: sw.Schedule or its name ("auto" simulates every schedule and keeps the fastest
            that fits; "gpipe", "1f1b", "zb-h1", "interleaved", "zb-v", "varuna", "harmony-pp", "harmony-dp",
            and the asynchronous "2bw", which needs `asynchronous`).
        cost: sw.CostModel or its name: "profile" times each layer here (cached on disk),
            "analytic" derives times from FLOPs and the devices' peak rates; None: compile
            profiles, sw.plan (whose devices need not be here) is analytic.
        split_points: module names to cut before (e.g. ["blocks.2"]); None lets the planner cut.
        replicas: data-parallel copies of the pipeline (P x D); "auto" simulates every D;
            a tuple gives each stage its own count; "per-stage" lets PipeDream's DP choose.
        stages: the pipeline depth P (default: devices / replicas); "auto" simulates every depth.
        virtual_devices: plan for this many devices placed on the physical ones by speed, so
            training is bitwise the same on any count (`pipe.resize`); compile only.
        asynchronous: allow updates with stale gradients, which train differently from eager:
            needed by schedule="2bw" (PipeDream-2BW), and lets "auto" weigh it (default False).

    Raises:
        BatchSizeError: `microbatches` is not a positive int.
        OptionError: an unknown schedule or cost, or another field of the wrong type or range;
            schedule="2bw" without asynchronous=True, or asynchronous=True with a synchronous schedule.

    Example:
        >>> sw.PlanOptions(microbatches=4, schedule="1f1b")
        PlanOptions(microbatches=4, schedule=<Schedule.ONE_F_ONE_B: '1f1b'>, cost=None, split_points=None, replicas=1, stages=None, virtual_devices=None, asynchronous=False)
    """

    microbatches: int | None = None
    schedule: Schedule | str = Schedule.AUTO
    cost: CostModel | str | None = None
    split_points: tuple[str, ...] | list[str] | None = None
    replicas: int | str | tuple[int, ...] = 1
    stages: int | str | None = None
    virtual_devices: int | None = None
    asynchronous: bool = False

    def __post_init__(self) -> None:
        check_microbatch_count(self.microbatches)
        object.__setattr__(self, "schedule", parse_choice(Schedule, self.schedule, "schedule "))
        check_flags(asynchronous=self.asynchronous)
        if self.cost is not None:
            object.__setattr__(self, "cost", parse_choice(CostModel, self.cost, "cost="))
        check_split_points(self.split_points)
        if self.split_points is not None:
            object.__setattr__(self, "split_points", tuple(self.split_points))
        if isinstance(self.replicas, list):  # replicas=[2, 1] reads as (2, 1)
            object.__setattr__(self, "replicas", tuple(self.replicas))
        check_replicas_and_stages(self.replicas, self.stages, self.split_points)
        v = self.virtual_devices
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise OptionError(f"virtual_devices={v!r} must be a positive int (at least the physical devices "
                              "given), or None to plan for the devices themselves")


@dataclass(frozen=True)
class MemoryOptions:
    """Where training state lives when the devices' memory is short.

    Args:
        swap: sw.SwapMode or its name: "auto" swaps state (weights, gradients, optimizer state)
            to host memory only where a device's capacity requires it, "on" forces Harmony-style
            swapping, "per-device" the per-GPU baseline, "all" is "on" plus every stage's
            stashed activations, "off" never swaps.
        optimizer_on_host: the optimizer steps fp32 masters in host memory (Harmony's CPU update,
            ZeRO-Offload), so no device holds optimizer state.
        activations: sw.ActivationPolicy or its name, what each stage does with the activations
            its forwards save for the backward: "auto" keeps them where they fit and elsewhere
            recomputes or swaps them, whichever the simulator predicts faster (per stage); "keep",
            "recompute" (every stage that holds more than one at a time) or "swap" force one. For
            gpipe, 1f1b, interleaved and Harmony (one policy for all its packs); varuna keeps its own.

    Raises:
        OptionError: an unknown swap mode or activation policy, one the swap mode contradicts
            ("swap" with swap="off"; "keep" or "recompute" with swap="all"), or `optimizer_on_host`
            not a bool.

    Example:
        >>> sw.MemoryOptions(swap="on")
        MemoryOptions(swap=<SwapMode.ON: 'on'>, optimizer_on_host=False, activations=<ActivationPolicy.AUTO: 'auto'>)
    """

    swap: SwapMode | str = SwapMode.AUTO
    optimizer_on_host: bool = False
    activations: ActivationPolicy | str = ActivationPolicy.AUTO

    def __post_init__(self) -> None:
        swap = parse_choice(SwapMode, self.swap, "swap=")
        object.__setattr__(self, "swap", swap)
        check_flags(optimizer_on_host=self.optimizer_on_host)
        object.__setattr__(self, "activations", check_activations(self.activations, swap))


@dataclass(frozen=True)
class TrainingOptions:
    """How each step computes, beside the loss and the optimizer.

    Args:
        clip_grad_norm: clip the global gradient norm to this (as clip_grad_norm_); None: no clipping.
        seed: random ops draw from streams keyed by (seed, step, op, microbatch); None takes
            torch.initial_seed().
        precision: "fp32", "bf16" (stage forwards under torch.autocast, fp32 weights, gradients
            and optimizer state) or "fp16" (the same with dynamic loss scaling; sw.LossScaling(...)
            for your own settings): a step whose gradients overflow is skipped on every stage.
        shape_buckets: pad each step's sequences (dimension 1) at the end up to a multiple of this
            int, or to the smallest of these lengths, so many lengths run as a few shapes; the
            targets are padded with the loss's ignore index and an attention mask with 0. compile
            checks on the example that the loss is unchanged, else refuses naming the input.
        compile_stages: run each stage module through torch.compile (inductor): faster kernels,
            results equal to eager within rounding, not bitwise (docs/guide/performance.md).
        cuda_graphs: capture each stage's forward and backward per microbatch and shape as CUDA
            graphs and replay them (the same kernels: bitwise the eager pipeline's); CUDA only.

    Raises:
        OptionError: `clip_grad_norm` not a positive finite number, `seed` not an int,
            `shape_buckets` not a positive int or a list of positive lengths, or
            `compile_stages` / `cuda_graphs` not a bool.
        PrecisionError: an unknown precision.

    Example:
        >>> sw.TrainingOptions(clip_grad_norm=1.0, precision="bf16")
        TrainingOptions(clip_grad_norm=1.0, seed=None, precision='bf16', shape_buckets=None, compile_stages=False, cuda_graphs=False)
    """

    clip_grad_norm: float | None = None
    seed: int | None = None
    precision: str | LossScaling = "fp32"
    shape_buckets: int | tuple[int, ...] | list[int] | None = None
    compile_stages: bool = False
    cuda_graphs: bool = False

    def __post_init__(self) -> None:
        check_flags(compile_stages=self.compile_stages, cuda_graphs=self.cuda_graphs)
        check_clip_grad_norm(self.clip_grad_norm)
        check_seed(self.seed)
        check_precision(self.precision)
        parse_shape_buckets(self.shape_buckets)


OptionGroup = PlanOptions | MemoryOptions | TrainingOptions
GROUPS: dict[str, type[OptionGroup]] = {"plan": PlanOptions, "memory": MemoryOptions, "training": TrainingOptions}

Arguments = ParamSpec("Arguments")
Result = TypeVar("Result")


def given_once(function: Callable[Arguments, Result]) -> Callable[Arguments, Result]:
    """Wraps compile / plan: each group keyword holds its class, and no option is given both as a
    flat keyword and inside a group (which value was meant cannot be known, so neither is taken)."""

    @functools.wraps(function)
    def checked(*args: Arguments.args, **kwargs: Arguments.kwargs) -> Result:
        for keyword, group_class in GROUPS.items():
            group = kwargs.get(keyword)
            if group is None:
                continue
            if not isinstance(group, group_class):
                raise OptionError(f"{keyword}= is a {type(group).__name__}; give sw.{group_class.__name__}(...), "
                                  f"e.g. {keyword}=sw.{group_class.__name__}()")
            twice = next((f.name for f in fields(group_class) if f.name in kwargs), None)
            if twice is not None:
                raise OptionError(f"{twice}= is given both as a keyword of {function.__name__} and in "
                                  f"{keyword}=sw.{group_class.__name__}(...); give it once, e.g. only in the "
                                  f"{group_class.__name__}")
        return function(*args, **kwargs)

    return checked


def with_groups(flat: dict[str, Any], *groups: OptionGroup | None) -> dict[str, Any]:
    """`flat` (a call's keywords by name) with every field of each group given in place of its own."""
    merged = dict(flat)
    for group in groups:
        if group is not None:
            merged.update((f.name, getattr(group, f.name)) for f in fields(group))
    return merged
