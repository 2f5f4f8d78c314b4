"""`tensor_parallel=`: the option checked, this process's rank in its stage's group, and the
full parameters gathered back from the ranks' shards (state_dict gives the model's tensors).

This first slice runs one pipeline device (P = 1) whose stage spans every rank of the job:
`torchrun --nproc-per-node T` (or a process group of T ranks) with `tensor_parallel=T`. The
plan records which parameters are split and where the collectives are (ir/tensor_parallel.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from stagewise.ir.errors import DeviceError, OptionError
from stagewise.ir.tensor_parallel import TensorParallel
from stagewise.runtime.launch import distributed_context


def check_tensor_parallel(degree: object) -> None:
    """An int of at least 1 (1: no tensor parallelism)."""
    if isinstance(degree, bool) or not isinstance(degree, int) or degree < 1:
        raise OptionError(f"tensor_parallel={degree!r} must be an int of at least 1: the ranks each stage spans "
                          "(e.g. tensor_parallel=2 under `torchrun --nproc-per-node 2`), or 1 for none")


def check_supported(degree: int, devices: int, precision: str, compiled: bool) -> None:
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
    if devices != 1:
        raise OptionError(f"tensor_parallel={degree} runs one pipeline device spanning {degree} ranks (P = 1) in "
                          f"this version; give devices=['cpu'] (or one 'cuda'), not {devices} devices")


def tensor_parallel_rank(degree: int) -> int:
    """This process's rank in its stage's group: the job must be exactly `degree` ranks."""
    context = distributed_context()
    world = 1 if context is None else context.world_size
    if world != degree:
        raise DeviceError(f"tensor_parallel={degree} splits the stage over {degree} processes, but this job has "
                          f"{world}; launch with `torchrun --nproc-per-node {degree} script.py` (or "
                          f"dist.init_process_group with world_size={degree})")
    return dist.get_rank()


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
        result[name] = _gathered(sharded[name].full_of, found[name])
    return result


def local_part(parallel: TensorParallel, name: str, full: torch.Tensor) -> torch.Tensor:
    """This rank's part of `full`, the whole tensor `name` names (itself where not sharded)."""
    sharded = parallel.sharded().get(name)
    return full if sharded is None else sharded.shard_of(full, dist.get_rank(), parallel.degree)


def full_optimizer_state(state: dict[str, dict], parallel: TensorParallel) -> dict[str, dict]:
    """Per parameter name its optimizer state, the sharded ones' moments gathered whole (every rank calls it)."""
    sharded = parallel.sharded()
    result = {}
    for name in sorted(state):
        values = state[name]
        if name in sharded:
            values = {key: _gathered(sharded[name].full_of, value) for key, value in values.items()}
        result[name] = values
    return result


def local_optimizer_state(state: dict[str, dict], parallel: TensorParallel) -> dict[str, dict]:
    """`full_optimizer_state` undone: each sharded parameter's moments cut to this rank's part."""
    return {name: {key: local_part(parallel, name, value) if _per_element(value) else value
                   for key, value in values.items()} for name, values in state.items()}


def refuse_checkpoint(parallel: TensorParallel | None, what: str) -> None:
    """Checkpoints of split stages (DCP shards per rank, re-planned on load) are not written yet."""
    if parallel is not None:
        raise OptionError(f"{what} with tensor_parallel={parallel.degree} is not supported yet (a checkpoint would "
                          "need each rank's shards); save pipe.state_dict() and pipe.optimizer.state_dict(), which "
                          "are whole, with torch.save, or compile with tensor_parallel=1")


def _per_element(value: object) -> bool:
    """An optimizer state tensor with one entry per parameter element (not a step count)."""
    return isinstance(value, torch.Tensor) and value.dim() > 0


def _gathered(join: Callable[[list[torch.Tensor]], torch.Tensor], value: Any) -> Any:
    """`value` whole from every rank's part (`join`), or as it is where it is not per element."""
    if not _per_element(value):
        return value
    local = value.detach().contiguous()
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, local)
    return join(parts)
