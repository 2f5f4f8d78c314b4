"""Megatron's f and g (Narayanan Ch. 4): the two collectives generated stage code calls around a
sharded block, as autograd Functions over torch.distributed's all_reduce.

`tp_enter` (f) is the identity forward and sums its gradient over the stage's ranks backward: each
rank's column shards give only part of the input's gradient. `tp_all_reduce` (g) sums the row
matmul's partial outputs forward and passes the gradient through backward (every rank needs all of
it). They live in the IR, beside keyed dropout, because generated code names them; the process
group is this process's one stage group, set once by the runtime (`use_group`). On fake or meta
tensors (shape propagation of the stage code) they only pass the shape on.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import is_fake

_GROUP: list[dist.ProcessGroup | None] = [None]  # this process's tensor-parallel group


def use_group(group: dist.ProcessGroup | None) -> None:
    """The group every f and g of this process sums over (None: the default group, when the
    whole job is one stage's ranks)."""
    _GROUP[0] = group


def stage_group() -> dist.ProcessGroup | None:
    """This process's stage group, as `use_group` set it (None: the default group)."""
    return _GROUP[0]


def summed_over_ranks(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` summed over this process's stage group (a copy; a fake or meta tensor as it is)."""
    if is_fake(tensor) or tensor.is_meta:
        return tensor.clone()
    total = tensor.contiguous().clone()
    dist.all_reduce(total, op=dist.ReduceOp.SUM, group=_GROUP[0])
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
