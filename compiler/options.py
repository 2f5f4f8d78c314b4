"""What one compile is asked to do: the model and its example inputs, the options checked, the
devices resolved, and the facts about this process that the phases read."""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch

from stagewise.compiler.batches import batch_size, check_microbatches
from stagewise.ir.devices import Device, resolve_devices
from stagewise.ir.errors import ExampleInputsError, OversubscribedWarning, PlanError
from stagewise.ir.plan import DeviceSpec
from stagewise.passes.capture import input_names
from stagewise.passes.contention import available_cores, computes_at_full_speed
from stagewise.passes.layout import PER_STAGE
from stagewise.passes.schedule import SCHEDULES
from stagewise.runtime.launch import DistributedContext, distributed_context

DEFAULT_OPTIMIZER = functools.partial(torch.optim.SGD, lr=0.01)
COST_MODELS = ("profile", "analytic")


@dataclass(frozen=True)
class CompileOptions:
    """`compile()`'s keyword arguments (documented there), checked when made."""

    loss_fn: Callable | None = None
    example_target: object = None
    optimizer: Callable = DEFAULT_OPTIMIZER
    microbatches: int | None = None
    schedule: str = "auto"
    cost: str = "profile"
    split_points: tuple[str, ...] | None = None
    clip_grad_norm: float | None = None
    swap: str = "auto"
    replicas: int | str | tuple[int, ...] = 1
    stages: int | str | None = None
    optimizer_on_host: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.replicas, list):  # replicas=[2, 1] reads as (2, 1)
            object.__setattr__(self, "replicas", tuple(self.replicas))
        if self.cost not in COST_MODELS:
            raise PlanError(f"unknown cost={self.cost!r}; choose 'profile' (measure) or 'analytic' (FLOPs and peak rates)")
        if self.schedule not in SCHEDULES:
            raise PlanError(f"unknown schedule {self.schedule!r}; choose one of {', '.join(SCHEDULES)}")
        if not _valid_replicas(self.replicas):
            raise PlanError(f"replicas must be a positive int, 'auto', '{PER_STAGE}' or a tuple with a positive count "
                            f"per stage such as (2, 1), got {self.replicas!r}")
        if (self.replicas == PER_STAGE or isinstance(self.replicas, tuple)) and self.stages is not None:
            raise PlanError(f"replicas={self.replicas!r} places every stage's replicas itself; drop stages=")
        if self.replicas == PER_STAGE and self.split_points is not None:
            raise PlanError(f"replicas='{PER_STAGE}' lets PipeDream's DP choose the cuts; with split_points give each "
                            "stage's replicas, e.g. replicas=(2, 1)")
        if self.stages not in (None, "auto") and (not isinstance(self.stages, int) or self.stages < 1):
            raise PlanError(f"stages must be a positive int, 'auto' or None (every device), got {self.stages!r}")

    @property
    def searched(self) -> bool:
        """Whether the planner simulates candidates rather than building the one plan asked for."""
        if self.split_points is not None:
            return False
        return ("auto" in (self.replicas, self.stages) or self.replicas == PER_STAGE or self.schedule == "auto"
                or self.microbatches is None)

    @property
    def dynamic(self) -> bool:
        """Whether the planner weighs several microbatch counts, so the capture must serve every size
        (one count known in advance: a static export, about half the time of a symbolic one)."""
        return self.microbatches is None and self.split_points is None


def _valid_replicas(replicas: object) -> bool:
    """A count D of whole pipelines, 'auto', 'per-stage', or a count per stage."""
    def positive(n: object) -> bool:
        return isinstance(n, int) and not isinstance(n, bool) and n >= 1

    if isinstance(replicas, tuple):
        return bool(replicas) and all(positive(n) for n in replicas)
    return replicas in ("auto", PER_STAGE) or positive(replicas)


@dataclass(frozen=True)
class CompileRequest:
    """The model, its example inputs and options, the devices, and this process's share of them."""

    model: torch.nn.Module
    example_inputs: tuple | dict
    options: CompileOptions
    devices: list[Device]
    input_names: tuple[str, ...]
    input_kind: str
    batch: int
    first_microbatches: int  # the count the first trace is cut at (the planner's other counts reuse it)
    distributed: DistributedContext | None
    cores_at_full_speed: float  # single-device computes this process's cores run at full speed at once

    @classmethod
    def make(cls, model: torch.nn.Module, devices, example_inputs, options: CompileOptions) -> CompileRequest:
        """Check the model and inputs, resolve the devices, pick the first microbatch count."""
        if not isinstance(model, torch.nn.Module):
            raise ExampleInputsError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        resolved = resolve_devices(devices)
        distributed = distributed_context()
        _warn_if_oversubscribed(_sharing_cpu_devices(resolved, distributed))
        names, kind = input_names(model, example_inputs)
        batch = batch_size(example_inputs, options.example_target)
        if options.microbatches is not None:
            check_microbatches(batch, options.microbatches)
        first = options.microbatches or max(d for d in range(1, len(resolved) + 1) if batch % d == 0)
        return cls(model, example_inputs, options, resolved, tuple(names), kind, batch, first, distributed,
                   computes_at_full_speed())

    @property
    def specs(self) -> list[DeviceSpec]:
        return [d.spec() for d in self.devices]

    @property
    def capacities(self) -> list[int | None]:
        return [d.spec().memory for d in self.devices]

    @property
    def sharing_cpu_devices(self) -> int:
        """In-process CPU devices computing side by side on this process's cores."""
        return _sharing_cpu_devices(self.devices, self.distributed)


def _sharing_cpu_devices(devices: list[Device], distributed: DistributedContext | None) -> int:
    """One per rank under torch.distributed; else every CPU device of the plan."""
    return 1 if distributed is not None else sum(d.torch_device.type == "cpu" for d in devices)


def _warn_if_oversubscribed(cpu_devices: int) -> None:
    """Each in-process CPU device computes on its own thread with torch's intra-op threads; when
    they add up to more than the cores, OpenMP teams wait for descheduled members on every op
    (the demo's GPT-2 on 4 devices stepped in 135 ms with 2 threads each on 2 cores, 96 ms with 1)."""
    cores = available_cores()
    threads = torch.get_num_threads()
    if cpu_devices > 1 and threads > max(1, cores // cpu_devices):
        warnings.warn(
            f"{cpu_devices} CPU devices in this process, each computing with {threads} intra-op threads, "
            f"oversubscribe the {cores} cores available; call torch.set_num_threads({max(1, cores // cpu_devices)}) "
            "before compiling (or run one process per device under torchrun)", OversubscribedWarning, stacklevel=4)
