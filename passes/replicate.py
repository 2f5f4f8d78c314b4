"""Data-parallel replicas of stages (PipeDream's replicated stages; Harmony DP; P x D).

A logical stage replicated r ways becomes r stage instances (same `logical` position, replica
0..r-1), each with its own device and its own microbatches. The replicas' parameters are then
simply tensors held by several stages, so the shared tensor pass groups them and the same
all-reduce that keeps tied weights tied sums the replicas' gradients before the update
(synchronous data parallelism).

Two shapes: `replicate` copies the whole pipeline D times (P x D, Varuna §4.4): instance r of
stage s sends to instance r of stage s+1, and lane r takes the r-th contiguous share of the
microbatches. `replicate_stages` gives every stage its own count (PipeDream's replicated stages,
dissertation §2.4.1, e.g. "2-1": stage 0 on two devices, stage 1 on one): replica r of a stage on
n devices takes the microbatches k with k mod n == r, PipeDream's round robin (1F1B-RR, §2.4.2),
and sends each one to the instance of the next stage that takes it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
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


def replicate_stages(
    stages: tuple[Stage, ...],
    transfers: tuple[Transfer, ...],
    devices: Sequence[Sequence[int]],
    microbatches: int,
) -> tuple[tuple[Stage, ...], tuple[Transfer, ...]]:
    """Logical stage s runs on the devices `devices[s]`, one instance each, numbered in pipeline
    order (stage 0's replicas first); a stage on one device keeps every microbatch. A transfer is
    copied for every pair of instances that share a microbatch."""
    if len(devices) != len(stages) or any(not d for d in devices):
        raise ValueError(f"devices {devices} must list at least one device for each of the {len(stages)} stages")
    crowded = [s for s, on in enumerate(devices) if len(on) > microbatches]
    if crowded:
        raise BatchSizeError(
            f"stage {crowded[0]} has {len(devices[crowded[0]])} replicas but there are only {microbatches} "
            "microbatches: each replica needs at least one; use more microbatches or fewer replicas"
        )
    instances: list[Stage] = []
    index_of: dict[tuple[int, int], int] = {}
    for stage, on in zip(stages, devices, strict=True):
        for r, device in enumerate(on):
            index_of[stage.index, r] = len(instances)
            owned = tuple(range(r, microbatches, len(on))) if len(on) > 1 else ()
            instances.append(replace(stage, index=len(instances), device=device, logical=stage.index, replica=r,
                                     microbatches=owned))
    owned_by = {s.index: set(s.microbatches or range(microbatches)) for s in instances}
    copies = tuple(
        replace(t, src=index_of[t.src, a], dst=index_of[t.dst, b])
        for t in transfers
        for a in range(len(devices[t.src]))
        for b in range(len(devices[t.dst]))
        if owned_by[index_of[t.src, a]] & owned_by[index_of[t.dst, b]]
    )
    return tuple(instances), copies
