"""Tensor parallelism within a stage (Megatron, Narayanan Ch. 4): what the plan records.

A stage spans `degree` ranks. Each `ShardedBlock` is one of Megatron's pairs found in the traced
graph: column matmuls (sharded by output columns: q/k/v or fused c_attn by heads, an MLP's first
projection) whose input passes through `f` (identity forward, all-reduce of the gradient
backward), and one row matmul (sharded by input rows) whose output passes through `g` (all-reduce
forward, identity backward), its bias added after the sum. Everything else is replicated on the
stage's ranks. The literal sizes between the two (`view(x, [b, s, 96])`) are per-rank sizes in the
generated code: each is a `SizeEdit`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

import torch


class Placement(StrEnum):
    """How a parameter is split over a stage's ranks."""

    COLUMN = "column"  # by output features: each rank computes its own heads / hidden units
    ROW = "row"  # by input features: each rank a partial sum, all-reduced


@dataclass(frozen=True)
class ShardedParameter:
    """One parameter split over the ranks along `dim`; with `groups` > 1 (a fused q/k/v weight)
    the dim is `groups` equal parts each split alike, so every rank keeps its heads of each."""

    name: str  # the model's FQN
    placement: Placement
    dim: int
    groups: int = 1

    def shard_of(self, full: torch.Tensor, rank: int, degree: int) -> torch.Tensor:
        """This rank's part of the full tensor (a copy, contiguous)."""
        grouped = full.unflatten(self.dim, (self.groups, degree, full.shape[self.dim] // (self.groups * degree)))
        return grouped.select(self.dim + 1, rank).flatten(self.dim, self.dim + 1).contiguous()

    def part_shape(self, whole: tuple[int, ...], degree: int) -> tuple[int, ...] | None:
        """The shape of one rank's part of a tensor of shape `whole`; None where it does not split so."""
        if self.dim >= len(whole) or whole[self.dim] % (self.groups * degree):
            return None
        return whole[:self.dim] + (whole[self.dim] // degree,) + whole[self.dim + 1:]

    def full_of(self, shards: Sequence[torch.Tensor]) -> torch.Tensor:
        """The full tensor from every rank's shard, in rank order (`shard_of` undone)."""
        grouped = [s.unflatten(self.dim, (self.groups, s.shape[self.dim] // self.groups)) for s in shards]
        return torch.stack(grouped, self.dim + 1).flatten(self.dim, self.dim + 2)


@dataclass(frozen=True)
class SizeEdit:
    """A literal size of the full model made the per-rank one: `node.args[argument][index] = value`."""

    node: str
    argument: int
    index: int
    value: int


@dataclass(frozen=True)
class ShardedBlock:
    """One Megatron pair: `columns` read f(their input), `row`'s output is all-reduced (g)."""

    layer: int  # the layer holding it (a block never spans stages)
    columns: tuple[str, ...]  # the column matmul nodes
    row: str  # the row matmul node
    parameters: tuple[ShardedParameter, ...]
    edits: tuple[SizeEdit, ...] = ()


@dataclass(frozen=True)
class RankLayout:
    """Which torch.distributed rank runs which (pipeline device, tensor-parallel position): device d's
    stages span ranks d·degree .. d·degree + degree - 1, so a device's group is on neighbouring ranks
    (one host under torchrun's numbering) and position t of every device forms one pipeline, whose
    p2p messages and data-parallel all-reduces stay among ranks of that position."""

    devices: int  # pipeline devices of the plan
    degree: int = 1  # ranks per device (tensor_parallel=)

    @property
    def world_size(self) -> int:
        return self.devices * self.degree

    def rank(self, device: int, position: int) -> int:
        """The global rank running `device`'s stages at tensor-parallel `position`."""
        return device * self.degree + position

    def device_of(self, rank: int) -> int:
        return rank // self.degree

    def position_of(self, rank: int) -> int:
        return rank % self.degree

    def ranks_of(self, device: int) -> tuple[int, ...]:
        """The ranks one pipeline device's stages span (its tensor-parallel group), by position."""
        return tuple(self.rank(device, position) for position in range(self.degree))


@dataclass(frozen=True)
class TensorParallel:
    """A plan's tensor parallelism: every stage spans `degree` ranks (`RankLayout`), the blocks
    sharded on them, and why others were not."""

    degree: int
    blocks: tuple[ShardedBlock, ...]
    unsharded: tuple[str, ...] = ()  # one line per matmul pair left replicated, with the reason

    def layout(self, devices: int) -> RankLayout:
        """The ranks of a plan of `devices` pipeline devices with this degree."""
        return RankLayout(devices, self.degree)

    def sharded(self) -> dict[str, ShardedParameter]:
        """Every sharded parameter by its FQN."""
        return {p.name: p for block in self.blocks for p in block.parameters}

    def describe(self, layer_names: tuple[str, ...], devices: int) -> str:
        """The plan printout's section: the groups, and where each block's collectives are."""
        groups = ", ".join(f"dev{d} -> ranks {list(self.layout(devices).ranks_of(d))}" for d in range(devices))
        lines = [f"tensor parallel: {self.degree} ranks per stage ({groups}); parameters not listed are "
                 "replicated on a stage's ranks"]
        for block in self.blocks:
            columns = ", ".join(p.name + (f" (x{p.groups} heads groups)" if p.groups > 1 else "")
                                for p in block.parameters if p.placement is Placement.COLUMN)
            rows = ", ".join(p.name for p in block.parameters if p.placement is Placement.ROW)
            lines.append(f"  {layer_names[block.layer]}: all-reduce of the input gradient before "
                         f"{', '.join(block.columns)} (column: {columns}); all-reduce after {block.row} (row: {rows})")
        if not self.blocks:
            lines.append("  no pair of matmuls recognised: every rank computes the whole stage")
        lines.extend(f"  replicated: {reason}" for reason in self.unsharded)
        return "\n".join(lines)
