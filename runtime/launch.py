"""Whether this process is one rank of a torch.distributed job, and which.

torchrun starts one process per device and describes the job in environment variables
(RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT). The pipeline asks once: without
them (or with a world of one) everything runs in this process; with them, this process runs
the program of device RANK (RANK // T with `tensor_parallel=T`) and talks to the others through
`DistributedTransport`.
"""

from __future__ import annotations

import datetime
import os
from typing import NamedTuple

import torch
import torch.distributed as dist

from stagewise.ir.errors import DeviceError

DEFAULT_TIMEOUT_S = 300.0


class DistributedContext(NamedTuple):
    rank: int  # this process's global rank: the plan's device rank // T (`Plan.rank_layout()`)
    world_size: int  # number of processes = devices x tensor_parallel
    local_rank: int  # index among the processes of this machine (its CUDA device)


def distributed_context(timeout_s: float = DEFAULT_TIMEOUT_S) -> DistributedContext | None:
    """This rank's place in the job, initialising the default process group if needed; None when alone.

    A process group someone already initialised (the user, or a test with a file store) is
    used as it is; otherwise torchrun's environment is read and NCCL (a GPU per local process) or
    gloo started with `timeout_s`, so a collective on a dead peer fails instead of hanging.
    """
    if dist.is_available() and dist.is_initialized():
        if dist.get_world_size() == 1:
            return None
        rank = dist.get_rank()
        return DistributedContext(rank, dist.get_world_size(), int(os.environ.get("LOCAL_RANK", rank)))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size <= 1:
        return None
    context = _from_environment(world_size)
    _init_default_group(context, timeout_s)
    return context


def _from_environment(world_size: int) -> DistributedContext:
    missing = [name for name in ("RANK", "MASTER_ADDR", "MASTER_PORT") if name not in os.environ]
    if missing or not dist.is_available():
        raise DeviceError(
            f"WORLD_SIZE={world_size} says this is one process of a distributed job, but it lacks "
            f"{', '.join(missing) or 'torch.distributed'}; launch with "
            f"`torchrun --nproc-per-node {world_size} script.py`, or unset WORLD_SIZE to run in one process"
        )
    rank = int(os.environ["RANK"])
    return DistributedContext(rank, world_size, int(os.environ.get("LOCAL_RANK", rank)))


def _init_default_group(context: DistributedContext, timeout_s: float) -> None:
    """NCCL (bound to this machine's device LOCAL_RANK first, as NCCL needs) where every process of
    this machine has its own GPU, else gloo. Every rank of a machine decides alike; a CPU plan on a
    machine with a GPU per process needs the caller's gloo group (`dist.init_process_group("gloo")`)."""
    timeout = datetime.timedelta(seconds=timeout_s)
    local_processes = int(os.environ.get("LOCAL_WORLD_SIZE", context.world_size))
    if torch.cuda.is_available() and torch.cuda.device_count() >= local_processes:
        torch.cuda.set_device(context.local_rank)
        dist.init_process_group("nccl", rank=context.rank, world_size=context.world_size, timeout=timeout,
                                device_id=torch.device("cuda", context.local_rank))
    else:
        dist.init_process_group("gloo", rank=context.rank, world_size=context.world_size, timeout=timeout)
