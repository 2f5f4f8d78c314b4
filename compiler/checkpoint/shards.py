"""A split stage's tensors in a checkpoint (`tensor_parallel=T`): the whole tensors as DCP sees
them, so that a pipeline of any T reads them by name, as any plan does (compiler/checkpoint/state.py).

Each rank writes its part of a parameter split along one dim (and of its per-element optimizer
state) as a DTensor over its stage group with a `Shard(dim)` placement: DCP records it as that
rank's chunk of the whole tensor and reads the whole back for any reader (torch's resharding).
A fused weight split by head groups (GPT-2's c_attn: q, k and v each split) is no one rectangle
of the whole (DCP refuses torch's `_StridedShard` as overlapping chunks), so its ranks gather it
whole when the save begins and DCP writes it once. A split stage reads each whole tensor into a
buffer and keeps its own part.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from stagewise.compiler.assembly.tensor_parallel import gathered, local_part, per_element
from stagewise.compiler.checkpoint.dcp import MODEL, OPTIMIZER_STATE
from stagewise.ir.errors import PlanError
from stagewise.ir.tensor_parallel import ShardedParameter, TensorParallel
from stagewise.ir.tensor_parallel_ops import stage_group


@dataclass(frozen=True)
class SavedSplit:
    """Which of this rank's saved tensors are its chunk of a whole tensor: key -> (dim, whole shape)."""

    mesh: DeviceMesh | None = None  # the stage group's, made when the save begins
    chunks: Mapping[str, tuple[int, tuple[int, ...]]] = field(default_factory=dict)

    def written(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """`tensors` as DCP writes them: each chunk a DTensor of its whole (no collective: may run on
        a save's thread)."""
        result = dict(tensors)
        for key, (dim, shape) in self.chunks.items():
            whole = torch.empty(shape, device="meta")
            result[key] = DTensor.from_local(tensors[key].cpu(), self.mesh, [Shard(dim)], run_check=False,
                                             shape=whole.shape, stride=whole.stride())
        return result


def split_for_saving(tensors: dict[str, torch.Tensor], parallel: TensorParallel | None) -> SavedSplit:
    """Note each split tensor of `tensors` (this rank's saved ones, by flattened key) as its chunk of
    the whole, and replace a fused one by its whole now: a collective of the stage group, called by
    every rank of it."""
    if parallel is None:
        return SavedSplit()
    chunks = {}
    for key in sorted(tensors):
        parameter = split_parameter(parallel, key)
        if parameter is None or not per_element(tensors[key]):
            continue
        if parameter.groups > 1:
            tensors[key] = gathered(parameter.full_of, tensors[key])
        else:
            shape = list(tensors[key].shape)
            shape[parameter.dim] *= parallel.degree
            chunks[key] = (parameter.dim, tuple(shape))
    group = stage_group()
    if chunks and group is None:
        raise PlanError("saving a split stage needs its ranks' process group, which the runtime sets under "
                        "torch.distributed: launch its T·P ranks with torchrun")
    return SavedSplit(DeviceMesh.from_group(group, "cpu") if chunks and group is not None else None, chunks)


def whole_buffers(wanted: dict[str, torch.Tensor], parallel: TensorParallel | None
                  ) -> list[tuple[str, torch.Tensor]]:
    """Replace each split tensor of `wanted` (flattened key -> the tensor to fill) by an empty buffer
    of its whole shape, for DCP to read into; returns (key, the tensor that takes this rank's part)."""
    if parallel is None:
        return []
    parts = []
    for key in sorted(wanted):
        parameter = split_parameter(parallel, key)
        if parameter is None or not per_element(wanted[key]):
            continue
        local = wanted[key]
        shape = list(local.shape)
        shape[parameter.dim] *= parallel.degree
        wanted[key] = torch.empty(shape, dtype=local.dtype)
        parts.append((key, local))
    return parts


def keep_parts(wanted: Mapping[str, torch.Tensor], parts: list[tuple[str, torch.Tensor]],
               parallel: TensorParallel | None) -> None:
    """Copy this rank's part of each whole tensor read (`whole_buffers`) into the tensor it was for."""
    for key, local in parts:
        local.copy_(_part(parallel, key, wanted[key]))


def optimizer_parts(tensors: dict[str, torch.Tensor], parallel: TensorParallel | None) -> dict[str, torch.Tensor]:
    """A stage's optimizer tensors as read (whole, by flattened key) with each split one cut to this rank's part."""
    return {key: _part(parallel, key, tensor) if per_element(tensor) else tensor for key, tensor in tensors.items()}


def split_parameter(parallel: TensorParallel, key: str) -> ShardedParameter | None:
    """The split parameter a flattened checkpoint key belongs to (its weight or its optimizer state)."""
    sharded = parallel.sharded()
    if key.startswith(OPTIMIZER_STATE + "."):
        return sharded.get(key[len(OPTIMIZER_STATE) + 1:].rsplit(".", 1)[0])
    if key.startswith(MODEL + "."):
        return sharded.get(key[len(MODEL) + 1:])
    return None


def _part(parallel: TensorParallel | None, key: str, whole: torch.Tensor) -> torch.Tensor:
    """This rank's part of `whole` (the tensor under `key`), or `whole` where it is not split."""
    parameter = None if parallel is None else split_parameter(parallel, key)
    return whole if parameter is None or parallel is None else local_part(parallel, parameter.name, whole)
