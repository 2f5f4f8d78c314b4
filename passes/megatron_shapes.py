"""How sharding flows through the ops between a Megatron pair, and the literal sizes it changes.

Each value between the column and the row matmuls is split over the ranks along one dimension
(`Shard`): its `groups` equal parts each split alike (a fused q/k/v output has 3). An op is
recognised only where every rank can run it on its part and get its part of the full result:
pointwise ops (torch's `pointwise` tag) with replicated operands of size 1 along the split,
views that keep the split outermost in its block (heads, never the head dimension), transposes,
splits into the q/k/v groups, and scaled-dot-product attention over heads. A literal size of the
full model in a view, reshape, expand or split becomes the per-rank size (`SizeEdit`). Anything
else raises `Unrecognised`, and the pair stays replicated.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass

import torch
import torch.fx as fx

from stagewise.ir.tensor_parallel import SizeEdit

aten = torch.ops.aten
_VIEWS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default}
_PASS = {aten.clone.default, aten.contiguous.default, aten.alias.default, aten.detach.default,
         aten.to.dtype, aten.to.dtype_layout, aten._to_copy.default, aten.lift_fresh_copy.default}
_SPLITS = {aten.split.Tensor, aten.split_with_sizes.default}


class Unrecognised(Exception):
    """An op between the pair that does not split over heads or features; the reason says which."""


class DropoutInside(Exception):  # noqa: N818 - turned into the user's OptionError by the caller
    """Dropout with p > 0 between a pair: its ranks would need streams of their own."""


class Regroup(Exception):  # noqa: N818 - a signal, not an error: propagate again with more groups
    """A split showed the columns' output is `groups` fused parts (q, k, v): start again with them."""

    def __init__(self, groups: int):
        super().__init__(groups)
        self.groups = groups


@dataclass(frozen=True)
class Shard:
    dim: int
    groups: int = 1


def shape_of(node: object) -> tuple[int, ...]:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    if not isinstance(val, torch.Tensor):
        raise Unrecognised(f"{node} has no traced tensor value")
    return tuple(int(s) for s in val.shape)


class Propagation:
    """The shard of every value of one block, in graph order, and the size edits it needs."""

    def __init__(self, degree: int):
        self.degree = degree
        self.shards: dict[fx.Node, Shard | tuple[Shard, ...]] = {}
        self.edits: list[SizeEdit] = []

    def shard(self, node: fx.Node) -> Shard:
        found = self.shards.get(node)
        if found is None:
            raise Unrecognised(f"{node.name}, not split, meets the split values")
        if not isinstance(found, Shard):
            raise Unrecognised(f"{node.name} is a tuple of shards used as a tensor")
        return found

    def visit(self, node: fx.Node) -> None:
        """Record `node`'s shard from its inputs' (all visited), or raise `Unrecognised`."""
        target = node.target
        if target is operator.getitem:
            parts = self.shards[node.args[0]]  # type: ignore[index]  # a split's output, visited before
            if not isinstance(parts, tuple):
                raise Unrecognised(f"{node.name} indexes a tensor")
            self.shards[node] = parts[node.args[1]]  # type: ignore[index]  # the split's item
        elif target is aten._assert_tensor_metadata.default and "size" not in node.kwargs:
            return
        elif target in (aten.dropout.default, aten.native_dropout.default):
            if node.args[1] != 0.0:
                raise DropoutInside(node.name)
            self.shards[node] = self.shard(node.args[0])  # type: ignore[arg-type]
        elif target in _PASS or (isinstance(target, torch._ops.OpOverload) and torch.Tag.pointwise in target.tags):
            self.shards[node] = self._pointwise(node)
        elif target in _VIEWS:
            self.shards[node] = self._view(node)
        elif target is aten.expand.default:
            self.shards[node] = self._expand(node)
        elif target is aten.scaled_dot_product_attention.default:
            self.shards[node] = self._attention(node)
        elif target in _SPLITS:
            self.shards[node] = self._split(node)
        else:
            self.shards[node] = self._layout(node)

    def _pointwise(self, node: fx.Node) -> Shard:
        """Every sharded operand split alike (counted from the right); the others broadcast along it."""
        out = shape_of(node)
        tensors = [a for a in node.args if isinstance(a, fx.Node)]
        sharded = [(a, self.shard(a)) for a in tensors if a in self.shards]
        offsets = {len(shape_of(a)) - s.dim for a, s in sharded}
        groups = {s.groups for _, s in sharded}
        if len(offsets) != 1 or len(groups) != 1:
            raise Unrecognised(f"{node.name} combines values split along different dimensions")
        offset = offsets.pop()
        for other in (a for a in tensors if a not in self.shards):
            shape = shape_of(other)
            if len(shape) >= offset and shape[-offset] != 1:
                raise Unrecognised(f"{node.name} reads {other.name}, not split, of full size along the split")
        return Shard(len(out) - offset, groups.pop())

    def _view(self, node: fx.Node) -> Shard:
        """The split moves to the output dim whose suffix holds as many elements as the input's
        split dim and its suffix (the outermost factor of its block: heads, not the head size)."""
        source = node.args[0]
        shard, before, after = self.shard(source), shape_of(source), shape_of(node)  # type: ignore[arg-type]
        inner = math.prod(before[shard.dim:])
        dims = [o for o in range(len(after)) if math.prod(after[o:]) == inner
                and after[o] % (shard.groups * self.degree) == 0]
        if not dims:
            raise Unrecognised(f"{node.name} reshapes the split dimension {before} -> {after} across heads")
        self._edit_size(node, 1, dims[0], after[dims[0]])
        return Shard(dims[0], shard.groups)

    def _expand(self, node: fx.Node) -> Shard:
        source = node.args[0]
        shard, before, after = self.shard(source), shape_of(source), shape_of(node)  # type: ignore[arg-type]
        dim = shard.dim + len(after) - len(before)
        self._edit_size(node, 1, dim, after[dim])
        return Shard(dim, shard.groups)

    def _edit_size(self, node: fx.Node, argument: int, index: int, full: int) -> None:
        sizes = node.args[argument]
        value = sizes[index]  # type: ignore[index]
        if value == -1:
            return
        if not isinstance(value, int) or value != full or full % self.degree:
            raise Unrecognised(f"{node.name} gives the split dimension as {value}, not the literal {full}")
        self.edits.append(SizeEdit(node.name, argument, index, full // self.degree))

    def _attention(self, node: fx.Node) -> Shard:
        """Heads are independent: q, k and v split by heads, the mask broadcast over them."""
        q, k, v = node.args[:3]
        mask = node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
        dropout = node.args[4] if len(node.args) > 4 else node.kwargs.get("dropout_p", 0.0)
        if dropout:
            raise DropoutInside(node.name)
        if node.kwargs.get("enable_gqa"):
            raise Unrecognised(f"{node.name} repeats key/value heads itself (enable_gqa)")
        heads = len(shape_of(node)) - 3
        if any(self.shard(t) != Shard(heads) for t in (q, k, v)):  # type: ignore[arg-type]
            raise Unrecognised(f"{node.name}'s query, key and value are not all split by heads")
        if isinstance(mask, fx.Node) and (mask in self.shards or shape_of(mask)[-3] != 1):
            raise Unrecognised(f"{node.name}'s mask differs per head")
        return Shard(heads)

    def _split(self, node: fx.Node) -> tuple[Shard, ...]:
        """Along the split: one piece per fused group (q, k, v), each split alike; elsewhere it passes."""
        source = node.args[0]
        shard, before = self.shard(source), shape_of(source)  # type: ignore[arg-type]
        dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)
        dim = dim % len(before)  # type: ignore[operator]
        count = len(node.meta["val"])
        if dim != shard.dim:
            return (shard,) * count
        sizes = node.args[1]
        if node.target is aten.split_with_sizes.default and len(set(sizes)) != 1:  # type: ignore[arg-type]
            raise Unrecognised(f"{node.name} splits the split dimension unevenly")
        if shard.groups != count:
            raise Regroup(count)
        if node.target is aten.split.Tensor:
            if sizes % self.degree:  # type: ignore[operator]
                raise Unrecognised(f"{node.name}'s parts do not divide by {self.degree}")
            self.edits.append(SizeEdit(node.name, 1, -1, sizes // self.degree))  # type: ignore[operator]
        else:
            for index, size in enumerate(sizes):  # type: ignore[arg-type]
                self.edits.append(SizeEdit(node.name, 1, index, size // self.degree))
        return (Shard(dim),) * count

    def _layout(self, node: fx.Node) -> Shard:
        """Transposes, unsqueezes and slices or concatenations along other dims move or keep the split."""
        target, args = node.target, node.args
        if target in (aten.cat.default,):
            parts, dim = args[0], (args[1] if len(args) > 1 else 0)
            sharded = [self.shard(p) for p in parts if p in self.shards]  # type: ignore[union-attr]
            empty = all(p in self.shards or math.prod(shape_of(p)) == 0 for p in parts)  # type: ignore[union-attr]
            rank = len(shape_of(node))
            if not empty or len(set(sharded)) != 1 or dim % rank == sharded[0].dim:  # type: ignore[operator]
                raise Unrecognised(f"{node.name} concatenates along the split or with unsplit values")
            return sharded[0]
        shard = self.shard(args[0])  # type: ignore[arg-type]
        rank = len(shape_of(args[0]))
        if target is aten.transpose.int:
            a, b = (d % rank for d in args[1:3])  # type: ignore[operator]
            return Shard({a: b, b: a}.get(shard.dim, shard.dim), shard.groups)
        if target is aten.permute.default:
            order = [d % rank for d in args[1]]  # type: ignore[union-attr]
            return Shard(order.index(shard.dim), shard.groups)
        if target is aten.unsqueeze.default:
            at = args[1] % (rank + 1)  # type: ignore[operator]
            return Shard(shard.dim + (at <= shard.dim), shard.groups)
        if target in (aten.slice.Tensor, aten._softmax.default, aten.softmax.int) and args[1] % rank != shard.dim:  # type: ignore[operator]
            return shard
        raise Unrecognised(f"{node.name} ({target}) between the pair")

