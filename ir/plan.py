"""The intermediate representation shared by passes, codegen, the simulator and the runtime.

Small frozen dataclasses with no torch objects inside, so a Plan round-trips through JSON
(`Plan.to_json` / `Plan.from_json`) and a saved pipeline can be read without the model class.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields, replace

from stagewise.ir.choices import ActivationPolicy, CostModel, Schedule, parse_choice
from stagewise.ir.costs import RuntimeCosts
from stagewise.ir.devices import DeviceSpec
from stagewise.ir.errors import CheckpointError
from stagewise.ir.instructions import Phase
from stagewise.ir.plan_checks import activations_run, check_plan
from stagewise.ir.program import Program, programs_from_text
from stagewise.ir.report import plan_group, render_plan
from stagewise.ir.tensor_parallel import (
    Placement,
    RankLayout,
    ShardedBlock,
    ShardedParameter,
    SizeEdit,
    TensorParallel,
)
from stagewise.ir.time_split import Bound, TimeSplit
from stagewise.ir.topology import Level, Topology


@dataclass(frozen=True)
class Layer:
    """A contiguous run of graph nodes that belong to one module (the unit the partitioner moves)."""

    index: int
    name: str
    nodes: tuple[str, ...]
    params: tuple[str, ...]
    buffers: tuple[str, ...]
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    param_bytes: int = 0
    flops: int = 0


@dataclass(frozen=True)
class CrossingValue:
    """A value produced on the left of a cut and used on its right."""

    name: str
    bytes_per_sample: float
    is_tensor: bool
    requires_grad: bool


@dataclass(frozen=True)
class Cut:
    """The position between layer `after` and layer `after + 1` (Varuna §5.1 cut-points)."""

    after: int
    values: tuple[CrossingValue, ...]
    legal: bool
    reason: str = ""

    @property
    def bytes_per_sample(self) -> float:
        return sum(v.bytes_per_sample for v in self.values)


@dataclass(frozen=True)
class SharedTensor:
    """A parameter or buffer held by several stages (Varuna §5.2 cross-partition state).

    `names` are every FQN the tensor has in the original model (a tied embedding has two);
    `stages` the stages holding a replica; `owner` the stage whose copy counts once in
    global reductions such as the gradient norm. A frozen parameter (`trainable` False) has no
    gradient: summing zeros into it would let weight decay move it.
    """

    fqn: str
    names: tuple[str, ...]
    stages: tuple[int, ...]
    kind: str  # "tied-parameter" | "parameter" | "buffer"
    nbytes: int = 0  # one copy's bytes: what summing its gradient across the holders moves
    trainable: bool = True  # False for a buffer and a frozen parameter (requires_grad=False)

    @property
    def summed(self) -> bool:
        """Whether the holders' gradients are all-reduced before each update."""
        return self.kind != "buffer" and self.trainable

    @property
    def owner(self) -> int:
        return self.stages[0]


@dataclass(frozen=True)
class Transfer:
    """A value sent from the stage that makes it to a stage that uses it.

    `route` is "direct": a skip connection from stage 0 to stage 3 is sent straight to 3.
    """

    value: str
    src: int
    dst: int
    bytes_per_sample: float
    requires_grad: bool
    route: str = "direct"
    shape: tuple[int, ...] = ()  # for one microbatch; a receiver allocates its buffer from it
    dtype: str = "float32"


@dataclass(frozen=True)
class Stage:
    """The layers bound to one device, the values it takes in and gives out, and what it does with its
    stashed activations (`activations`: keep, recompute or swap; plans saved before read as their programs run)."""

    index: int
    device: int
    layers: tuple[int, ...]
    inputs: tuple[str, ...]  # stage-module argument order: graph inputs then received values
    outputs: tuple[str, ...]  # stage-module return order; the last stage returns the loss first
    params: tuple[str, ...]
    buffers: tuple[str, ...]
    logical: int = -1  # the pipeline position (pack) this stage instance runs; -1: same as index
    replica: int = 0  # data-parallel replica of the logical stage
    microbatches: tuple[int, ...] = ()  # the microbatches this instance processes; () = all
    activations: ActivationPolicy = ActivationPolicy.KEEP  # never AUTO: the policy the programs run

    @property
    def position(self) -> int:
        return self.index if self.logical < 0 else self.logical


@dataclass(frozen=True)
class Task:
    """One unit of schedule: forward, recompute or backward of a stage on a microbatch, or its
    update. A forward with `stash=False` keeps only its inputs (as the Forward instruction it
    lowers to); a recompute task re-runs it with autograd just before the backward (Varuna §3.2)."""

    phase: Phase
    stage: int
    microbatch: int | None = None
    stash: bool = True


@dataclass(frozen=True)
class InputSpec:
    """What `step` checks one of its tensors against: the example's dtype and its sizes after the
    batch dimension (`batched`: dim 0 is the batch; a 0-d tensor is every microbatch's as it is).
    The example's sizes are the largest the memory was planned for; `lowest` the smallest the stage
    code takes (a size the graph fixed has lowest == shape; () in plans saved before: fixed)."""

    dtype: str  # as torch prints it: "torch.float32"
    shape: tuple[int, ...]  # sizes after dim 0 (all sizes when not batched)
    batched: bool = True
    lowest: tuple[int, ...] = ()  # per size of `shape`: the smallest a step may give


@dataclass(frozen=True)
class Plan:
    """Everything compile decided: layers, cuts, shared tensors, stages, transfers, programs. It is
    `pipe.plan` and what `sw.plan` returns; `print(plan)` shows the stage table, and it round-trips
    through JSON (a checkpoint's plan.json). Made by the planner, not by hand.

    Args:
        model: the model's class name.
        tracer: what captured it, 'fx' or 'export'.
        devices: each device's `DeviceSpec`.
        input_names: the model's inputs, in order.
        input_kind: whether step takes the inputs as positional or keyword arguments.
        target_name: the loss target's input name, None without `loss_fn`.
        graph_inputs: the graph nodes of the inputs (then the target), in that order.
        microbatches: microbatches per step.
        microbatch_size: samples per microbatch of the example batch.
        schedule: the chosen `sw.Schedule`.
        layers: the graph's layers.
        cuts: the legal cut points between layers.
        shared: tensors several stages use (tied weights).
        stages: which layers and parameters each stage holds, on which device.
        transfers: the values sent between stages.
        programs: one instruction program per device.
        state_names: every key of the model's state_dict.
        aliases: groups of names of one tensor.
        state_shapes: per state name, its shape.
        cost_model: where the predictions come from (None: a plan made by hand).
        predicted_iteration_s: the simulated time of one step.
        predicted_stage_s: per stage, forward + backward of one microbatch.
        predicted_peak_bytes: per device, its simulated peak memory.
        predicted_host_bytes: per device, what the runtime keeps for it in host memory.
        predicted_split: where the predicted iteration's time goes, and its bound (ir/time_split.py).
        considered: the candidate plans the planner simulated, one line each.
        costs: what the predictions charged, so a loaded plan predicts the same.
        input_specs: per input (then the target), the shapes and dtypes step accepts.
        seed: the key of the random streams dropout draws from.
        smallest_microbatch: the fewest samples a microbatch may hold (0: `microbatch_size`).
        training: the model's mode at compile, the pipeline's starting mode.
        precision: 'fp32', 'bf16' or 'fp16'.
        output_spec: the model output's pytree structure, what `pipe.predict` rebuilds.
        output_nodes: per leaf of `output_spec`, the graph node computing it.
        tensor_parallel: the ranks each stage spans and its sharded parameters; None: one rank each.

    Example:
        >>> pipe.plan.model, pipe.plan.microbatches, len(pipe.plan.stages), pipe.plan.state_names[:2]
        ('Sequential', 2, 2, ('0.weight', '0.bias'))
    """

    model: str
    tracer: str
    devices: tuple[DeviceSpec, ...]
    input_names: tuple[str, ...]
    input_kind: str  # "positional" | "keyword"
    target_name: str | None
    graph_inputs: tuple[str, ...]  # graph node names of input_names (+ the target), in that order
    microbatches: int
    microbatch_size: int
    schedule: Schedule
    layers: tuple[Layer, ...]
    cuts: tuple[Cut, ...]
    shared: tuple[SharedTensor, ...]
    stages: tuple[Stage, ...]
    transfers: tuple[Transfer, ...]
    programs: tuple[Program, ...] = field(default=())
    state_names: tuple[str, ...] = ()  # every key of the original model's state_dict
    aliases: tuple[tuple[str, ...], ...] = ()  # groups of FQNs naming one tensor (tied weights)
    state_shapes: tuple[tuple[int, ...], ...] = ()  # per state_names: what load_state_dict accepts
    cost_model: CostModel | None = None  # where the predictions come from (None: a plan made by hand)
    predicted_iteration_s: float | None = None
    predicted_stage_s: tuple[float, ...] = ()  # forward + backward of one microbatch, per stage
    predicted_peak_bytes: tuple[int, ...] = ()  # per device
    predicted_host_bytes: tuple[int, ...] = ()  # per device, kept in host memory (passes/capacity.py)
    predicted_split: TimeSplit | None = None  # compute, bubble, swap, p2p, all-reduce; the bound
    considered: tuple[str, ...] = ()  # the candidate plans the planner simulated, one line each
    costs: PlanCosts | None = None  # what the predictions charged: a loaded plan predicts the same
    input_specs: tuple[InputSpec, ...] = ()  # per input_names (then the target); () skips step's checks
    seed: int = 0  # random ops draw from streams keyed by (seed, step, op, microbatch): ir/random_streams.py
    smallest_microbatch: int = 0  # the fewest samples a microbatch may hold (uneven last batches); 0: microbatch_size
    training: bool = True  # the model's mode at compile: the pipeline's starting mode (pipe.train / pipe.eval)
    precision: str = "fp32"  # "bf16" | "fp16": stage forwards run under torch.autocast (ir/precision.py)
    output_spec: str | None = None  # the model output's structure, pytree JSON: what pipe.predict returns
    output_nodes: tuple[str | None, ...] = ()  # per leaf of output_spec, the graph node computing it (None: none)
    tensor_parallel: TensorParallel | None = None  # each stage over several ranks (ir/tensor_parallel.py)

    def rank_layout(self) -> RankLayout:
        """Which torch.distributed rank runs which device at which tensor-parallel position.

        Returns:
            The plan's RankLayout: device d at position t runs on rank d·T + t (T = 1 without
            tensor parallelism, so rank d runs device d).

        Example:
            >>> layout = pipe.plan.rank_layout()
            >>> layout.world_size, layout.rank(1, 0)
            (2, 1)
        """
        return RankLayout(len(self.devices), 1 if self.tensor_parallel is None else self.tensor_parallel.degree)

    def to_json(self) -> str:
        """The plan as JSON text, what a checkpoint's plan.json holds.

        Returns:
            JSON of every field; the programs in their printed form (typed instructions read back).

        Example:
            >>> print(pipe.plan.to_json()[:26])
            {
             "model": "Sequential",
        """
        data = asdict(replace(self, programs=()))
        data["programs"] = "\n".join(str(p) for p in self.programs)
        return json.dumps(data, indent=1)

    @classmethod
    def from_json(cls, text: str) -> Plan:
        """The plan `to_json` wrote, every number checked (ir/plan_checks.py): it may come from a crafted file.

        Args:
            text: plan.json's text.

        Returns:
            The plan, equal to the one written.

        Raises:
            CheckpointError: not a plan's JSON (fields missing, unknown or of the wrong type), a count,
                index, shape or dtype out of range, or an output structure that is not plain pytree JSON.

        Example:
            >>> sw.Plan.from_json(pipe.plan.to_json()) == pipe.plan
            True
        """
        try:
            data = json.loads(text)
            programs = programs_from_text(data.pop("programs", ""))
            built = _with_policies_run(_build(cls, data), data, programs)
        except (ValueError, TypeError, KeyError, AttributeError) as error:  # a StagewiseError passes as it is
            raise CheckpointError(f"this is not a plan stagewise wrote ({type(error).__name__}: {error}); read "
                                  "plan.json of a checkpoint saved by this version of stagewise") from error
        return check_plan(replace(built, programs=programs))

    def __str__(self) -> str:
        return render_plan(self)

    def __rich__(self):
        """rich's console.print shows the same tables (it would pretty-print the dataclass's fields)."""
        return plan_group(self)


def _with_policies_run(plan: Plan, data: dict, programs: tuple[Program, ...]) -> Plan:
    """A plan saved before stages recorded their activation policy: each such stage's as its programs run it."""
    unrecorded = {i for i, stage in enumerate(data.get("stages", ())) if isinstance(stage, dict)
                  and "activations" not in stage}
    if not unrecorded:
        return plan
    run = activations_run(programs)
    return replace(plan, stages=tuple(replace(s, activations=run.get(s.index, ActivationPolicy.KEEP))
                                      if i in unrecorded else s for i, s in enumerate(plan.stages)))


def _build(cls, data):
    """Rebuild nested frozen dataclasses (and tuples) from `asdict` output."""
    hints = {f.name: f.type for f in fields(cls)}
    kwargs = {}
    for name, value in data.items():
        kwargs[name] = _convert(hints[name], value)
    return cls(**kwargs)


_NESTED = {}


def _convert(hint: str, value):
    if hint == "Schedule":
        return parse_choice(Schedule, value, "schedule ")
    if hint == "ActivationPolicy":
        return parse_choice(ActivationPolicy, value, "activations=")
    if hint == "CostModel | None":  # "": a hand-made plan's, written before the cost model was an enum
        return None if value in (None, "") else parse_choice(CostModel, value, "cost_model=")
    if hint == "Bound":
        return Bound(value)
    if hint == "Placement":
        return Placement(value)
    if isinstance(value, dict):  # a nested dataclass: `Name` or `Name | None`
        return _build(_NESTED[hint.split("|")[0].strip()], value)
    if isinstance(value, list):
        inner = hint[hint.find("[") + 1 : hint.find(",")] if hint.startswith("tuple[") else ""
        nested = _NESTED.get(inner.strip())
        return tuple(_build(nested, v) if nested else _convert(inner, v) for v in value)
    return value


@dataclass(frozen=True)
class LayerCost:
    """One layer's seconds and bytes at microbatch size `u` (Harmony §4.2 profiles, Srifty §3 fits).

    Times are per microbatch: `fwd_s` the forward with autograd recording, `bwd_s` its backward,
    `recompute_s` the forward re-run before a backward (Harmony's recompute). State bytes do not
    depend on u: parameters, their gradients, and optimizer state (AdamW: two moments).
    `act_bytes` is the layer's output (what a cut after it sends), `stash_bytes` what autograd
    saves for the backward (parameters excluded), `workspace_bytes` transient memory above those.
    """

    layer: int
    u: int
    fwd_s: float
    bwd_s: float
    recompute_s: float
    param_bytes: int
    grad_bytes: int
    optim_bytes: int
    act_bytes: int
    stash_bytes: int
    workspace_bytes: int

    @property
    def state_bytes(self) -> int:
        """Bytes held all the time: parameters, gradients and optimizer state."""
        return self.param_bytes + self.grad_bytes + self.optim_bytes


@dataclass(frozen=True)
class PlanCosts:
    """What the plan's predictions charged, so that a loaded plan predicts the same: each layer's
    costs at the plan's microbatch size (profiled or analytic), the links between its devices,
    what the runtime adds, and the stages whose training state lives in host memory."""

    layers: tuple[LayerCost, ...]
    topology: Topology
    runtime: RuntimeCosts
    swapped: tuple[int, ...] = ()


_NESTED.update(
    {
        cls.__name__: cls
        for cls in (Layer, InputSpec, CrossingValue, Cut, SharedTensor, Transfer, Stage, DeviceSpec, LayerCost, PlanCosts, Topology,
                    Level, RuntimeCosts, TimeSplit, TensorParallel, ShardedBlock, ShardedParameter, SizeEdit)
    }
)
