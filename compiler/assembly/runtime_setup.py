"""The runtime of one plan in this process: a memory pool per device, the transport between
devices (in memory, or torch.distributed under torchrun), a worker per local stage and the
executor that runs the local devices' programs. `compile` sets it up as its last phase, `load`
from a checkpoint."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.fx as fx

from stagewise.compiler.assembly.optimizer_groups import ParamGroups, StageOptimizerFactory
from stagewise.compiler.assembly.state_dict import model_name
from stagewise.compiler.assembly.step_shapes import StateSpecs, state_specs
from stagewise.ir.errors import DeviceError, PlanError
from stagewise.ir.instructions import StashOut
from stagewise.ir.plan import Plan, Stage
from stagewise.ir.precision import LossScaling
from stagewise.ir.tensor_parallel_ops import use_group
from stagewise.runtime.distributed import DistributedTransport
from stagewise.runtime.executor import DEFAULT_TIMEOUT_S, StreamExecutor
from stagewise.runtime.launch import DistributedContext, distributed_context
from stagewise.runtime.pool import MemoryPool
from stagewise.runtime.stage_calls import EAGER, Acceleration, stage_call
from stagewise.runtime.transport import LocalTransport
from stagewise.runtime.worker import StageWorker


@dataclass(frozen=True)
class Runtime:
    context: DistributedContext | None  # None: every device in this process
    pools: list[MemoryPool]  # one per device of the plan
    transport: LocalTransport | DistributedTransport
    workers: list[StageWorker]  # this process's stages
    executor: StreamExecutor
    optimizer_factory: Callable  # what each stage's optimizer was made with
    stage_modules: list[fx.GraphModule | None]  # every stage's (another rank's on the meta device), for shapes
    stage_states: list[StateSpecs | None]  # every stage's parameter and buffer sizes, for shapes
    clip_grad_norm: float | None
    acceleration: Acceleration = EAGER  # compile_stages / cuda_graphs: a checkpoint keeps them


def start_runtime(plan: Plan, modules: Sequence[fx.GraphModule | None], optimizer: Callable,
                  clip_grad_norm: float | None, swapped: frozenset[int] = frozenset(),
                  loss_scaling: LossScaling | None = None, acceleration: Acceleration = EAGER) -> Runtime:
    """Pools, transport, this process's stage workers (modules[i] runs stage i, None where another
    rank holds it; `swapped`: the stages whose state lives in host memory between uses; `acceleration`:
    compiled or graphed stage calls) and their executor (`loss_scaling`: fp16's, default LossScaling())."""
    layout = plan.rank_layout()
    context = distributed_context()
    local = set(range(len(plan.devices))) if context is None else {layout.device_of(context.rank)}
    pools = [MemoryPool(i, _torch_device(plan, i, context), d.memory) for i, d in enumerate(plan.devices)]
    transport: LocalTransport | DistributedTransport
    if context is None:
        transport = LocalTransport(pools)
    else:
        transport = DistributedTransport(plan, context.rank, pools, DEFAULT_TIMEOUT_S)
        use_group(transport.tensor_group, transport.wait_stage_sum)  # the stage code's f and g: this device's ranks
    states = [state_specs(m) if m is not None else None for m in modules]  # before swapping empties them
    received_with_grad = {(t.dst, t.value) for t in plan.transfers if t.requires_grad}
    last = max(s.position for s in plan.stages)
    stash_swaps = {(i.stage, i.microbatch) for p in plan.programs for i in p.instructions
                   if isinstance(i, StashOut)}
    workers = [
        StageWorker(
            stage,
            module,
            pools[stage.device],
            _stage_optimizer(plan, module, optimizer),
            owned=_owned_names(plan, stage.index, module),
            grad_inputs={v for (dst, v) in received_with_grad if dst == stage.index},
            is_last=stage.position == last,
            shared_names=_shared_names(plan, stage.index, module),
            swapped=stage.index in swapped,
            swapped_stashes=frozenset(mb for s, mb in stash_swaps if s == stage.index),
        )
        for stage, module in _local_modules(plan, modules, local)
    ]
    sharded = frozenset(plan.tensor_parallel.sharded()) if plan.tensor_parallel is not None else frozenset()
    for worker in workers:
        worker.call = stage_call(worker.module, worker.stage.index, plan.precision, acceleration)
        worker.sharded = sharded & {name for name, _ in worker.module.named_parameters()}
        if plan.schedule.weight_versions > 1:  # 2bw (runtime/weight_versions.py)
            worker.weight_versions.keep(worker.params, worker.pool, worker.stage.index, worker.swapped)
    executor = StreamExecutor(tuple(p for p in plan.programs if p.device in local), workers, transport,
                              clip_grad_norm, {s.index: s.device for s in plan.stages}, seed=plan.seed,
                              precision=plan.precision,
                              loss_scaling=(loss_scaling or LossScaling()) if plan.precision == "fp16" else None)
    others = [m.to("meta") if m is not None and s.device not in local else m
              for s, m in zip(plan.stages, modules, strict=True)]  # their shapes only: no memory
    return Runtime(context, pools, transport, workers, executor, optimizer, others, states, clip_grad_norm,
                   acceleration)


def _local_modules(plan: Plan, modules: Sequence[fx.GraphModule | None],
                   local: set[int]) -> list[tuple[Stage, fx.GraphModule]]:
    """The stages this process runs with their modules (None only for another rank's)."""
    held = [(stage, module) for stage, module in zip(plan.stages, modules, strict=True) if stage.device in local]
    missing = [stage.index for stage, module in held if module is None]
    if missing:
        raise PlanError(f"stages {missing} run in this process but no module was given for them")
    return [(stage, module) for stage, module in held if module is not None]


def _stage_optimizer(plan: Plan, module: torch.nn.Module, optimizer: Callable) -> Callable:
    """What the stage's worker makes its optimizer with: named groups (`ParamGroups`) see the
    stage's parameters under the model's names (a tied one under its first name, as
    `model.named_parameters()` gives it)."""
    if not isinstance(optimizer, ParamGroups):
        return optimizer
    return StageOptimizerFactory(optimizer, {id(p): model_name(plan, n) for n, p in module.named_parameters()})


def _torch_device(plan: Plan, index: int, context: DistributedContext | None) -> torch.device:
    """This process's device; under torchrun on CUDA the local rank's GPU."""
    device = torch.device(plan.devices[index].name)
    if context is not None and device.type == "cuda":
        if context.local_rank >= torch.cuda.device_count():
            raise DeviceError(
                f"rank {context.rank} (local rank {context.local_rank}) runs a CUDA device of the plan, but this "
                f"machine has {torch.cuda.device_count()} GPU(s): under torchrun each process needs its own GPU; "
                "start at most that many processes per machine, or give 'cpu' devices")
        return torch.device("cuda", context.local_rank)
    return device


def _shared_names(plan: Plan, stage: int, module: torch.nn.Module) -> dict[str, str]:
    """Canonical FQN of each tensor the stage shares with others -> the stage's own name for it."""
    local = {n for n, _ in module.named_parameters(remove_duplicate=False)}
    local |= {n for n, _ in module.named_buffers(remove_duplicate=False)}
    result = {}
    for tensor in plan.shared:
        if stage in tensor.stages:
            result[tensor.fqn] = next(n for n in tensor.names if n in local)
    return result


def _owned_names(plan: Plan, stage: int, module: torch.nn.Module) -> set[str]:
    """Parameters whose gradient this stage counts once in the global norm."""
    not_owned = {n for t in plan.shared if stage in t.stages and t.owner != stage for n in t.names}
    return {n for n, _ in module.named_parameters() if n not in not_owned}
