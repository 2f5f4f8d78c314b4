"""What one compile is asked to do: the model and its example inputs, the options checked, the
devices resolved, and the facts about this process that the phases read."""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch

from stagewise.compiler.assembly.asynchronous import check_asynchronous
from stagewise.compiler.assembly.batches import batch_size, check_microbatches, input_specs
from stagewise.compiler.assembly.layout_options import check_layout_options
from stagewise.compiler.assembly.optimizer_groups import ParamGroups, check_param_groups, sample_optimizer
from stagewise.compiler.assembly.stage_acceleration import check_devices
from stagewise.compiler.assembly.tensor_parallel import (
    check_supported,
    check_tensor_parallel,
    tensor_parallel_position,
)
from stagewise.ir.choices import ActivationPolicy, CostModel, Schedule, parse_choice
from stagewise.ir.devices import Device, check_present, resolve_devices
from stagewise.ir.errors import (
    BatchSizeError,
    ExampleInputsError,
    LossError,
    OptionError,
    OversubscribedWarning,
    PlanError,
    PrecisionError,
)
from stagewise.ir.plan import DeviceSpec, InputSpec
from stagewise.ir.precision import LossScaling, check_precision
from stagewise.ir.topology import Topology
from stagewise.passes.capture import input_names
from stagewise.passes.contention import available_cores, computes_at_full_speed
from stagewise.passes.layout import PER_STAGE
from stagewise.passes.swap import SwapMode
from stagewise.runtime.launch import DistributedContext, distributed_context
from stagewise.runtime.stage_calls import EAGER, Acceleration

DEFAULT_OPTIMIZER = functools.partial(torch.optim.SGD, lr=0.01)


@dataclass(frozen=True)
class CompileOptions:
    """`compile()`'s keyword arguments (documented there), checked when made."""

    loss_fn: Callable | None = None
    example_target: object = None
    optimizer: Callable = DEFAULT_OPTIMIZER
    microbatches: int | None = None
    schedule: Schedule = Schedule.AUTO  # a member or its string: read as the member when made
    cost: CostModel = CostModel.PROFILE
    split_points: tuple[str, ...] | None = None
    clip_grad_norm: float | None = None
    swap: SwapMode = SwapMode.AUTO
    activations: ActivationPolicy = ActivationPolicy.AUTO  # a member or its string: read as the member when made
    replicas: int | str | tuple[int, ...] = 1
    stages: int | str | None = None
    optimizer_on_host: bool = False
    seed: int | None = None
    precision: str = "fp32"  # checked by ir/precision.py check_precision before
    loss_scaling: LossScaling | None = None  # fp16's (LossScaling() unless given)
    topology: Topology | None = None  # the links between the devices, given (else measured, or modelled by sw.plan)
    # (fewest, most) samples per microbatch the graph may be planned at: a re-planned export graph's
    # (compiler/elastic/replan.py); None: any
    microbatch_sizes: tuple[int, int] | None = None
    acceleration: Acceleration = EAGER  # compile_stages, cuda_graphs (runtime/stage_calls.py)
    tensor_parallel: int = 1  # ranks each stage spans (compiler/assembly/tensor_parallel.py)
    asynchronous: bool = False  # stale-gradient schedules (2bw) allowed (compiler/assembly/asynchronous.py)

    def __post_init__(self) -> None:
        if isinstance(self.replicas, list):  # replicas=[2, 1] reads as (2, 1)
            object.__setattr__(self, "replicas", tuple(self.replicas))
        _check_loss(self.loss_fn, self.example_target)
        _check_optimizer(self.optimizer)
        _check_scalars(self)
        _check_layout(self)
        check_asynchronous(self)
        _check_precision(self)
        check_tensor_parallel(self.tensor_parallel)

    @property
    def searched(self) -> bool:
        """Whether the planner simulates candidates rather than building the one plan asked for."""
        if self.split_points is not None:
            return False
        return ("auto" in (self.replicas, self.stages) or self.replicas == PER_STAGE or self.schedule == Schedule.AUTO
                or self.microbatches is None)

    @property
    def reduces_grad_norm(self) -> bool:
        """Whether every update waits for the global gradient norm: to clip, or as fp16's overflow check."""
        return self.clip_grad_norm is not None or self.precision == "fp16"

    @property
    def dynamic(self) -> bool:
        """Whether the planner weighs several microbatch counts, so the capture must serve every size
        (one count known in advance: a static export, about half the time of a symbolic one)."""
        return self.microbatches is None and self.split_points is None


def check_flags(**flags: object) -> None:
    """Yes/no options are True or False: any other value (a truthy "no", 0, None) is refused rather
    than read by its truthiness, which would silently do the opposite of what was meant."""
    for option, value in flags.items():
        if not isinstance(value, bool):
            raise OptionError(f"{option}={value!r} must be True or False (a bool, not {type(value).__name__})")


def _check_loss(loss_fn: object, example_target: object) -> None:
    """A loss_fn comes with an example target (a tensor), and a target with a loss_fn."""
    if loss_fn is not None and not callable(loss_fn):
        raise LossError(f"loss_fn={loss_fn!r} is not callable; give a function (output, target) -> scalar loss, "
                        "e.g. loss_fn=torch.nn.functional.cross_entropy")
    if loss_fn is not None and example_target is None:
        raise LossError("loss_fn is given without example_target: pass example_target= (a batch of targets like "
                        "those step(..., target=) will get), so the loss can be traced with the model")
    if loss_fn is None and example_target is not None:
        raise LossError("example_target is given without loss_fn: pass loss_fn=(output, target) -> loss, or drop "
                        "example_target if the model returns its own loss")
    if example_target is not None and not isinstance(example_target, torch.Tensor):
        raise ExampleInputsError(f"example_target is a {type(example_target).__name__}; give a tensor with the batch "
                                 "along dim 0, as step(..., target=) will get")


def _check_optimizer(factory: object) -> None:
    """A factory `params -> torch.optim.Optimizer` (each stage makes its own optimizer over its own
    parameters; a checkpoint records the class it makes and its defaults, not the factory)."""
    fix = "pass a factory such as functools.partial(torch.optim.AdamW, lr=1e-3)"
    if isinstance(factory, torch.optim.Optimizer):
        raise OptionError(f"optimizer= is a {type(factory).__name__} instance over the model's parameters; each "
                          f"stage makes its own optimizer over its own parameters: {fix}")
    if not callable(factory):
        raise OptionError(f"optimizer={factory!r} is not callable; {fix}")
    try:
        made = sample_optimizer(factory)
    except Exception as err:  # noqa: BLE001 - any failure of the user's factory is reported as one
        raise OptionError(f"optimizer={factory!r} fails when called with a list of parameters "
                          f"({type(err).__name__}: {err}); {fix}") from None
    if not isinstance(made, torch.optim.Optimizer):
        raise OptionError(f"optimizer= returned a {type(made).__name__}, not a torch.optim.Optimizer; {fix}")


def _check_scalars(options: CompileOptions) -> None:
    """Counts, norms and flags of the right type and range (a negative or NaN clip norm trains wrongly)."""
    check_clip_grad_norm(options.clip_grad_norm)
    check_microbatch_count(options.microbatches)
    check_flags(optimizer_on_host=options.optimizer_on_host, compile_stages=options.acceleration.compile_stages,
                cuda_graphs=options.acceleration.cuda_graphs)
    object.__setattr__(options, "swap", parse_choice(SwapMode, options.swap, "swap="))
    object.__setattr__(options, "activations", check_activations(options.activations, options.swap))
    check_seed(options.seed)
    check_split_points(options.split_points)


def check_activations(activations: object, swap: SwapMode) -> ActivationPolicy:
    """`activations=` as a member, and one the swap mode allows: swap="off" moves no stash to host
    memory, swap="all" moves every one (so keeping or recomputing them contradicts it)."""
    policy = parse_choice(ActivationPolicy, activations, "activations=")
    if policy is ActivationPolicy.SWAP and swap is SwapMode.OFF:
        raise OptionError("activations='swap' moves stashed activations to host memory, which swap='off' forbids; "
                          "give swap='auto', or activations='keep' or 'recompute'")
    if policy in (ActivationPolicy.KEEP, ActivationPolicy.RECOMPUTE) and swap is SwapMode.ALL:
        raise OptionError(f"activations='{policy}' contradicts swap='all', which swaps every stage's stashed "
                          "activations; give swap='on' (state only), or activations='auto' or 'swap'")
    return policy


def check_clip_grad_norm(clip: object) -> None:
    """A positive finite norm or None: a negative or NaN one would train wrongly, not fail."""
    if clip is not None and (isinstance(clip, bool) or not isinstance(clip, int | float)
                             or not math.isfinite(clip) or clip <= 0):
        raise OptionError(f"clip_grad_norm={clip!r} must be a positive finite number (the largest gradient norm "
                          "kept), e.g. clip_grad_norm=1.0, or None for no clipping")


def check_microbatch_count(m: object) -> None:
    """A positive int, or None for the planner's choice."""
    if m is not None and (isinstance(m, bool) or not isinstance(m, int) or m < 1):
        raise BatchSizeError(f"microbatches must be a positive int, got {m!r}; e.g. microbatches=4, or None to let "
                             "the planner choose")


def check_seed(seed: object) -> None:
    """What random ops' streams are keyed by: a 64-bit unsigned int, or None."""
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**64):
        raise OptionError(f"seed={seed!r} must be an int from 0 to 2**64 - 1 (what random ops' streams are keyed "
                          "by), e.g. seed=0, or None for torch.initial_seed() (what torch.manual_seed set)")


def check_split_points(points: object) -> None:
    """A list (or tuple) of module names: a string would be read as one name per character."""
    if points is None:
        return
    if not isinstance(points, list | tuple):
        example = [points] if isinstance(points, str) else ["blocks.2"]
        raise OptionError(f"split_points={points!r} must be a list of layer names, e.g. split_points={example!r}")
    if not all(isinstance(p, str) and p for p in points):
        raise OptionError(f"split_points={list(points)!r} must name layers by their module names (strings), "
                          "e.g. split_points=['blocks.2']")


def _check_layout(options: CompileOptions) -> None:
    """Cost model, schedule, replicas and stages: known names, positive counts, no contradictions."""
    object.__setattr__(options, "cost", parse_choice(CostModel, options.cost, "cost="))
    object.__setattr__(options, "schedule", parse_choice(Schedule, options.schedule, "schedule "))
    check_replicas_and_stages(options.replicas, options.stages, options.split_points)


def check_replicas_and_stages(replicas: object, stages: object, split_points: object) -> None:
    """Known replica and stage counts that do not contradict each other or the split points."""
    if not _valid_replicas(replicas):
        raise PlanError(f"replicas must be a positive int, 'auto', '{PER_STAGE}' or a tuple with a positive count "
                        f"per stage such as (2, 1), got {replicas!r}")
    if (replicas == PER_STAGE or isinstance(replicas, tuple)) and stages is not None:
        raise PlanError(f"replicas={replicas!r} places every stage's replicas itself; drop stages=")
    if replicas == PER_STAGE and split_points is not None:
        raise PlanError(f"replicas='{PER_STAGE}' lets PipeDream's DP choose the cuts; with split_points give each "
                        "stage's replicas, e.g. replicas=(2, 1)")
    if stages not in (None, "auto") and (isinstance(stages, bool) or not isinstance(stages, int) or stages < 1):
        raise PlanError(f"stages must be a positive int, 'auto' or None (every device), got {stages!r}")


def _check_precision(options: CompileOptions) -> None:
    """A known precision; loss scaling only where fp16 needs it."""
    if check_precision(options.precision) != options.precision:
        raise PrecisionError(f"precision={options.precision!r}: give the name, 'fp16', and the LossScaling apart")
    if options.loss_scaling is not None and (options.precision != "fp16"
                                             or not isinstance(options.loss_scaling, LossScaling)):
        raise PrecisionError(f"loss_scaling={options.loss_scaling!r} is for precision 'fp16' only (bf16 has fp32's "
                             "range and needs none); pass precision=sw.LossScaling(...) for fp16 with your settings")


def _check_model_precision(model: torch.nn.Module, precision: str, devices: list[Device]) -> None:
    """bf16 / fp16 train fp32 master weights under autocast, on devices torch's autocast supports."""
    if precision == "fp32":
        return
    for name, param in model.named_parameters():
        if param.dtype != torch.float32:
            raise PrecisionError(
                f"precision={precision!r} keeps fp32 master weights and casts them under torch.autocast, but the "
                f"model's {name!r} is {param.dtype}: compile model.float() (the masters; autocast computes in "
                f"{precision}), or precision='fp32' to train the {param.dtype} weights as they are")
    for device in devices:
        if not torch.amp.is_autocast_available(device.torch_device.type):
            raise PrecisionError(f"torch.autocast does not run on {device.torch_device.type!r} devices "
                                 f"({device.name}); use precision='fp32' there")


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
    input_specs: tuple[InputSpec, ...] = ()  # each example tensor's dtype and sizes, for step's checks
    seed: int = 0  # the plan's: `seed=`, else torch.initial_seed() (ir/random_streams.py)
    runs_here: bool = True  # False for sw.plan: no runtime, the devices need not exist, nothing is timed here

    @classmethod
    def make(cls, model: torch.nn.Module, devices, example_inputs, options: CompileOptions, *,
             runs_here: bool = True) -> CompileRequest:
        """Check the model and inputs, resolve the devices, pick the first microbatch count. A plan
        that will not run here (`runs_here=False`) takes a meta-device model and absent devices."""
        _check_model(model, weights_needed=runs_here)
        if isinstance(options.optimizer, ParamGroups):
            check_param_groups(options.optimizer, model)
        resolved = resolve_devices(devices)
        check_devices(options.acceleration, resolved)
        _check_topology(options.topology, len(resolved))
        check_layout_options(options.schedule, options.replicas, options.stages, options.split_points, len(resolved),
                             options.microbatches)
        if runs_here:
            check_present(resolved)
        elif options.cost != CostModel.ANALYTIC:
            raise OptionError(f"cost='{options.cost}' times layers on this machine's devices; a plan for devices that "
                              "need not be here is costed from their figures: cost='analytic'")
        _check_model_precision(model, options.precision, resolved)
        check_supported(options.tensor_parallel, options.precision,
                        options.acceleration.compile_stages or options.acceleration.cuda_graphs)
        if runs_here and options.tensor_parallel > 1:
            tensor_parallel_position(options.tensor_parallel, len(resolved))
        distributed = distributed_context() if runs_here else None
        if runs_here:
            _warn_if_oversubscribed(_sharing_cpu_devices(resolved, distributed))
        names, kind = input_names(model, example_inputs)
        batch = batch_size(example_inputs, options.example_target)
        if options.microbatches is not None:
            check_microbatches(batch, options.microbatches)
        first = options.microbatches or first_count(batch, len(resolved), options.microbatch_sizes)
        named = dict(zip(names, example_inputs.values() if isinstance(example_inputs, dict) else example_inputs,
                         strict=True))
        for name, tensor in named.items():
            if tensor.is_meta:
                raise ExampleInputsError(f"example input {name!r} is on the meta device (no data); give real "
                                         "tensors on 'cpu' or 'cuda'")
        target = [options.example_target] if isinstance(options.example_target, torch.Tensor) else []
        specs = input_specs([*named.values(), *target])
        seed = torch.initial_seed() if options.seed is None else options.seed
        return cls(model, example_inputs, options, resolved, tuple(names), kind, batch, first, distributed,
                   computes_at_full_speed(), specs, seed, runs_here)

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


def first_count(batch: int, devices: int, sizes: tuple[int, int] | None) -> int:
    """The microbatch count the first graph is cut at: the most, up to one per device, that divides
    the batch (into microbatches of `sizes`, when given)."""
    counts = [m for m in range(1, batch + 1) if batch % m == 0 and (sizes is None or sizes[0] <= batch // m <= sizes[1])]
    return max((m for m in counts if m <= devices), default=min(counts))


def _check_model(model: object, weights_needed: bool) -> None:
    """A module whose parameters and buffers hold data where it will train (a meta-device model has
    only shapes: enough to plan)."""
    if not isinstance(model, torch.nn.Module):
        raise ExampleInputsError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not weights_needed:
        return
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if tensor.is_meta:
            raise ExampleInputsError(f"the model's {name!r} is on the meta device (shapes, no data); materialise it "
                                     "first, e.g. model.to_empty(device='cpu') then load its weights (sw.plan plans "
                                     "a meta-device model as it is)")


def _check_topology(topology: object, devices: int) -> None:
    if topology is None:
        return
    if not isinstance(topology, Topology):
        raise OptionError(f"topology= is a {type(topology).__name__}; give a sw.Topology, e.g. "
                          f"sw.Topology.uniform({devices}, '25GB/s')")
    if len(topology.bandwidth) != devices:
        raise OptionError(f"topology= describes {len(topology.bandwidth)} devices but {devices} were given; "
                          "give one row per device, in the devices' order")


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
