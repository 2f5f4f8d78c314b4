"""A stage's part of the global gradient norm: the sum of its squared gradient entries.

Only the parameters the stage owns count (a tied one once, by its owner). Where a stage spans
several tensor-parallel ranks (ir/tensor_parallel.py), its sharded parameters add every rank's
squares and its replicated ones count once, so each rank's part is the whole stage's.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from stagewise.ir.tensor_parallel_ops import summed_over_ranks


def square_sum(module: torch.nn.Module, owned: set[str], sharded: frozenset[str], host: Mapping,
               device: torch.device) -> torch.Tensor:
    """The gradients where they are: on the device, or in `host` memory under ("grads", name)
    (swapped out, or sent to a host optimizer); float64 on `device`."""
    whole = torch.zeros((), dtype=torch.float64, device=device)
    shards = torch.zeros((), dtype=torch.float64, device=device)
    for name, param in sorted(module.named_parameters()):  # one order, also after sw.load
        grad = param.grad if param.grad is not None else host.get(("grads", name))
        if name in owned and grad is not None:
            part = grad.detach().double().pow(2).sum().to(device)
            if name in sharded:
                shards += part
            else:
                whole += part
    return whole + summed_over_ranks(shards) if sharded else whole
