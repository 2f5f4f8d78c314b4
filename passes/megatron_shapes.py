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


def as_int(value: object) -> int:
    """A literal int argument of a traced op (a symbolic size is not one)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise Unrecognised(f"{value!r} is not a literal int")
    return value


def as_ints(value: object) -> list[int]:
    if not isinstance(value, (list, tuple)):
        raise Unrecognised(f"{value!r} is not a list of sizes")
    return [as_int(v) for v in value]


def as_node(value: object) -> fx.Node:
    if not isinstance(value, fx.Node):
        raise Unrecognised(f"{value!r} is not a traced value")
    return value


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
            parts = self.shards.get(as_node(node.args[0]))
            if not isinstance(parts, tuple):
                raise Unrecognised(f"{node.name} indexes a tensor")
            self.shards[node] = parts[as_int(node.args[1])]
        elif target is aten._assert_tensor_metadata.default and "size" not in node.kwargs:
            return
        elif target in (aten.dropout.default, aten.native_dropout.default):
            if node.args[1] != 0.0:
                raise DropoutInside(node.name)
            self.shards[node] = self.shard(as_node(node.args[0]))
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
        source = as_node(node.args[0])
        shard, before, after = self.shard(source), shape_of(source), shape_of(node)
        inner = math.prod(before[shard.dim:])
        dims = [o for o in range(len(after)) if math.prod(after[o:]) == inner
                and after[o] % (shard.groups * self.degree) == 0]
        if not dims:
            raise Unrecognised(f"{node.name} reshapes the split dimension {before} -> {after} across heads")
        self._edit_size(node, 1, dims[0], after[dims[0]])
        return Shard(dims[0], shard.groups)

    def _expand(self, node: fx.Node) -> Shard:
        source = as_node(node.args[0])
        shard, before, after = self.shard(source), shape_of(source), shape_of(node)
        dim = shard.dim + len(after) - len(before)
        self._edit_size(node, 1, dim, after[dim])
        return Shard(dim, shard.groups)

    def _edit_size(self, node: fx.Node, argument: int, index: int, full: int) -> None:
        sizes = node.args[argument]
        value = sizes[index] if isinstance(sizes, (list, tuple)) else None
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
        if any(self.shard(as_node(t)) != Shard(heads) for t in (q, k, v)):
            raise Unrecognised(f"{node.name}'s query, key and value are not all split by heads")
        if isinstance(mask, fx.Node) and (mask in self.shards or shape_of(mask)[-3] != 1):
            raise Unrecognised(f"{node.name}'s mask differs per head")
        return Shard(heads)

    def _split(self, node: fx.Node) -> tuple[Shard, ...]:
        """Along the split: one piece per fused group (q, k, v), each split alike; elsewhere it passes."""
        source = as_node(node.args[0])
        shard, before = self.shard(source), shape_of(source)
        dim = as_int(node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)) % len(before)
        count = len(node.meta["val"])
        if dim != shard.dim:
            return (shard,) * count
        sizes = [as_int(node.args[1])] if node.target is aten.split.Tensor else as_ints(node.args[1])
        if len(set(sizes)) != 1 or sizes[0] % self.degree:
            raise Unrecognised(f"{node.name} splits the split dimension unevenly or not by {self.degree}")
        if shard.groups != count:
            raise Regroup(count)
        if node.target is aten.split.Tensor:
            self.edits.append(SizeEdit(node.name, 1, -1, sizes[0] // self.degree))
        else:
            self.edits.extend(SizeEdit(node.name, 1, i, size // self.degree) for i, size in enumerate(sizes))
        return (Shard(dim),) * count

    def _layout(self, node: fx.Node) -> Shard:
        """Transposes, unsqueezes and slices or concatenations along other dims move or keep the split."""
        target, args = node.target, node.args
        if target is aten.cat.default:
            parts = [as_node(p) for p in (args[0] if isinstance(args[0], (list, tuple)) else ())]
            sharded = [self.shard(p) for p in parts if p in self.shards]
            empty = all(p in self.shards or math.prod(shape_of(p)) == 0 for p in parts)
            dim = as_int(args[1] if len(args) > 1 else 0) % len(shape_of(node))
            if not empty or len(set(sharded)) != 1 or dim == sharded[0].dim:
                raise Unrecognised(f"{node.name} concatenates along the split or with unsplit values")
            return sharded[0]
        shard, rank = self.shard(as_node(args[0])), len(shape_of(args[0]))
        if target is aten.transpose.int:
            a, b = (as_int(d) % rank for d in args[1:3])
            return Shard({a: b, b: a}.get(shard.dim, shard.dim), shard.groups)
        if target is aten.permute.default:
            return Shard([d % rank for d in as_ints(args[1])].index(shard.dim), shard.groups)
        if target is aten.unsqueeze.default:
            at = as_int(args[1]) % (rank + 1)
            return Shard(shard.dim + (at <= shard.dim), shard.groups)
        if target in (aten.slice.Tensor, aten._softmax.default, aten.softmax.int) and as_int(args[1]) % rank != shard.dim:
            return shard
        raise Unrecognised(f"{node.name} ({target}) between the pair")

