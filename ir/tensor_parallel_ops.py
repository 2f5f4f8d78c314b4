"""Megatron's f and g (Narayanan Ch. 4): the two collectives generated stage code calls around a
sharded block, as autograd Functions over torch.distributed's all_reduce.

`tp_enter` (f) is the identity forward and sums its gradient over the stage's ranks backward: each
rank's column shards give only part of the input's gradient. `tp_all_reduce` (g) sums the row
matmul's partial outputs forward and passes the gradient through backward (every rank needs all of
it). They live in the IR, beside keyed dropout, because generated code names them; the process
group is this process's one stage group, set once by the runtime (`use_group`), with how to wait
for each sum: the runtime's transport polls it, so a step that failed on another rank stops it
instead of blocking until the process group's timeout, and records it, so that the drain completes
it for a partner that never joined. On fake or meta tensors (shape propagation of the stage code)
they only pass the shape on.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import is_fake

Wait = Callable[[dist.Work, torch.Tensor], None]  # waits for an issued all-reduce of that tensor
_GROUP: list[dist.ProcessGroup | None] = [None]  # this process's tensor-parallel group
_WAIT: list[Wait | None] = [None]


def use_group(group: dist.ProcessGroup | None, wait: Wait | None = None) -> None:
    """The group every f and g of this process sums over (None: the default group), and how each
    sum is waited for (None: a blocking wait)."""
    _GROUP[0], _WAIT[0] = group, wait


def stage_group() -> dist.ProcessGroup | None:
    """This process's stage group, as `use_group` set it (None: the default group)."""
    return _GROUP[0]


def summed_over_ranks(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` summed over this process's stage group (a copy; a fake or meta tensor as it is)."""
    if is_fake(tensor) or tensor.is_meta:
        return tensor.clone()
    total = tensor.contiguous().clone()
    work = dist.all_reduce(total, op=dist.ReduceOp.SUM, group=_GROUP[0], async_op=True)
    wait = _WAIT[0]
    if wait is None:
        work.wait()
    else:
        wait(work, total)
    return total


class _Enter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # noqa: ANN001 - autograd's context
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        return summed_over_ranks(grad)


class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        return summed_over_ranks(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        return grad


def tp_enter(x: torch.Tensor) -> torch.Tensor:
    """f: the input of a block's column matmuls; its gradient is all-reduced over the stage's ranks."""
    return _Enter.apply(x)


def tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """g: the row matmul's partial sums all-reduced over the stage's ranks (before its bias)."""
    return _AllReduce.apply(x)
