"""`tensor_parallel=`: the option checked, this process's rank in its stage's group, and the
full parameters gathered back from the ranks' shards (state_dict gives the model's tensors).

This first slice runs one pipeline device (P = 1) whose stage spans every rank of the job:
`torchrun --nproc-per-node T` (or a process group of T ranks) with `tensor_parallel=T`. The
plan records which parameters are split and where the collectives are (ir/tensor_parallel.py).
"""

from __future__ import annotations

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


def check_supported(degree: int, devices: int, clip_grad_norm: float | None, precision: str,
                    compiled: bool) -> None:
    """What this slice of tensor parallelism does not run yet, refused before anything is traced."""
    if degree == 1:
        return
    unsupported = {
        "clip_grad_norm": clip_grad_norm is not None,  # the norm would need the shards' squares summed
        "precision='fp16'": precision == "fp16",  # its overflow check is a global norm too
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


def full_state(found: dict[str, torch.Tensor], parallel: TensorParallel) -> dict[str, torch.Tensor]:
    """`found` with every sharded parameter gathered whole from the ranks (every rank calls it)."""
    sharded = parallel.sharded()
    result = dict(found)
    for name in sorted(n for n in found if n in sharded):
        local = found[name].detach().contiguous()
        parts = [torch.empty_like(local) for _ in range(parallel.degree)]
        dist.all_gather(parts, local)
        result[name] = sharded[name].full_of(parts)
    return result
