"""Data-parallel replicas of stages (PipeDream's replicated stages; Harmony DP; P x D).

A logical stage replicated D times becomes D stage instances, each with its own device and
its own share of the microbatches; instance r of stage s sends to instance r of stage s+1.
The replicas' parameters are then simply tensors held by several stages, so the shared
tensor pass groups them and the same all-reduce that keeps tied weights tied sums the
replicas' gradients before the update (synchronous data parallelism).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from stagewise.ir.errors import BatchSizeError
from stagewise.ir.plan import Stage, Transfer


def replicate(
    stages: tuple[Stage, ...],
    transfers: tuple[Transfer, ...],
    replicas: int,
    microbatches: int,
    device_of: Callable[[int, int], int],
) -> tuple[tuple[Stage, ...], tuple[Transfer, ...]]:
    """Instance r * P + s runs logical stage s on device_of(s, r) over the r-th share of microbatches."""
    if replicas == 1:
        return stages, transfers
    if microbatches % replicas:
        raise BatchSizeError(
            f"{replicas} data-parallel replicas need microbatches divisible by {replicas}, got {microbatches}"
        )
    p, share = len(stages), microbatches // replicas
    instances = tuple(
        replace(
            stage,
            index=r * p + stage.index,
            device=device_of(stage.index, r),
            logical=stage.index,
            replica=r,
            microbatches=tuple(range(r * share, (r + 1) * share)),
        )
        for r in range(replicas)
        for stage in stages
    )
    copies = tuple(replace(t, src=r * p + t.src, dst=r * p + t.dst) for r in range(replicas) for t in transfers)
    return instances, copies
