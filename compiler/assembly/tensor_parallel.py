"""`tensor_parallel=`: the option checked, this process's position in its stage's group, and the
full parameters gathered back from the ranks' shards (state_dict gives the model's tensors).

Each of the P pipeline devices' stages spans T ranks: `torchrun --nproc-per-node T·P` (or a
process group of T·P ranks) with `tensor_parallel=T` (ir/tensor_parallel.py's `RankLayout` says
which rank runs which device at which position; P = 1 is one device over all T ranks). The plan
records which parameters are split and where the collectives are (ir/tensor_parallel.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from stagewise.ir.errors import DeviceError, OptionError
from stagewise.ir.tensor_parallel import RankLayout, TensorParallel
from stagewise.ir.tensor_parallel_ops import stage_group
from stagewise.runtime.launch import distributed_context


def check_tensor_parallel(degree: object) -> None:
    """An int of at least 1 (1: no tensor parallelism)."""
    if isinstance(degree, bool) or not isinstance(degree, int) or degree < 1:
        raise OptionError(f"tensor_parallel={degree!r} must be an int of at least 1: the ranks each stage spans "
                          "(e.g. tensor_parallel=2 under `torchrun --nproc-per-node 2`), or 1 for none")


def check_supported(degree: int, precision: str, compiled: bool) -> None:
    """What this slice of tensor parallelism does not run yet, refused before anything is traced."""
    if degree == 1:
        return
    unsupported = {
        "precision='fp16'": precision == "fp16",  # its loss scaling over split stages is untested
        "compile_stages / cuda_graphs": compiled,
    }
    refused = [name for name, given in unsupported.items() if given]
    if refused:
        raise OptionError(f"tensor_parallel={degree} does not run with {', '.join(refused)} yet; drop "
                          f"{'it' if len(refused) == 1 else 'them'}, or give tensor_parallel=1")


def tensor_parallel_position(degree: int, devices: int) -> int:
    """This process's position in its stage's group: the job must be exactly `degree` ranks per
    pipeline device."""
    context = distributed_context()
    world, layout = 1 if context is None else context.world_size, RankLayout(devices, degree)
    if world != layout.world_size:
        per = f" ({devices} pipeline devices x {degree})" if devices > 1 else ""
        raise DeviceError(f"tensor_parallel={degree} over {devices} pipeline device(s) needs {layout.world_size} "
                          f"processes{per}, but this job has {world}; launch with `torchrun --nproc-per-node "
                          f"{layout.world_size} script.py` (or dist.init_process_group with world_size="
                          f"{layout.world_size}), or give {world // degree or 1} device(s)")
    return layout.position_of(dist.get_rank())


def rank0_state(modules: Sequence[torch.nn.Module]) -> None:
    """Every rank's stage state made rank 0's (as DDP does at construction): replicated parameters
    must be equal on the ranks, and each rank's shards cut from the same whole tensors. A model
    initialised without a common seed would otherwise train different weights on each rank."""
    with torch.no_grad():
        for module in modules:
            for _, tensor in sorted({**dict(module.named_parameters()), **dict(module.named_buffers())}.items()):
                dist.broadcast(tensor.data, src=0)


def full_state(found: dict[str, torch.Tensor], parallel: TensorParallel) -> dict[str, torch.Tensor]:
    """`found` with every sharded parameter gathered whole from the ranks (every rank calls it)."""
    sharded = parallel.sharded()
    result = dict(found)
    for name in sorted(n for n in found if n in sharded):
        result[name] = gathered(sharded[name].full_of, found[name])
    return result


def local_part(parallel: TensorParallel, name: str, full: torch.Tensor) -> torch.Tensor:
    """This rank's part of `full`, the whole tensor `name` names (itself where not sharded)."""
    sharded = parallel.sharded().get(name)
    return full if sharded is None else sharded.shard_of(full, _position(parallel), parallel.degree)


def full_optimizer_state(state: dict[str, dict], parallel: TensorParallel) -> dict[str, dict]:
    """Per parameter name its optimizer state, the sharded ones' moments gathered whole (every rank calls it)."""
    sharded = parallel.sharded()
    result = {}
    for name in sorted(state):
        values = state[name]
        if name in sharded:
            values = {key: gathered(sharded[name].full_of, value) for key, value in values.items()}
        result[name] = values
    return result


def local_optimizer_state(state: dict[str, dict], parallel: TensorParallel) -> dict[str, dict]:
    """`full_optimizer_state` undone: each sharded parameter's moments cut to this rank's part."""
    return {name: {key: local_part(parallel, name, value) if per_element(value) else value
                   for key, value in values.items()} for name, values in state.items()}


def _position(parallel: TensorParallel) -> int:
    """This process's position in its stage's group."""
    return parallel.layout(dist.get_world_size() // parallel.degree).position_of(dist.get_rank())


def per_element(value: object) -> bool:
    """An optimizer state tensor with one entry per parameter element (not a step count)."""
    return isinstance(value, torch.Tensor) and value.dim() > 0


def gathered(join: Callable[[list[torch.Tensor]], torch.Tensor], value: Any) -> Any:
    """`value` whole from every rank's part (`join`: a `ShardedParameter.full_of`), or as it is where it
    is not per element (a collective of this process's stage group)."""
    if not per_element(value):
        return value
    local, group = value.detach().contiguous(), stage_group()
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, local, group=group)
    return join(parts)
