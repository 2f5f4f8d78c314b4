"""Megatron's pairs found in the traced graph (Narayanan Ch. 4), not from module names.

A column matmul (`aten.linear`, or `aten.addmm` / `aten.mm` with a transposed weight as Hugging
Face GPT-2's Conv1D traces) is followed, through the values it makes, until they all end in one
row matmul: the pair. Matmuls of the same input met on the way (q, k and v; a gated MLP's gate and
up) join the columns. The ops between must split over heads or features (passes/megatron_shapes.py);
the pair's parameters must be used nowhere else (a tied weight stays whole). What is not
recognised stays replicated on the stage's ranks, with the reason in the plan.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeGuard

import torch
import torch.fx as fx

from stagewise.ir.errors import OptionError
from stagewise.ir.plan import Layer
from stagewise.ir.subgraph import attribute
from stagewise.ir.tensor_parallel import Placement, ShardedBlock, ShardedParameter, TensorParallel
from stagewise.passes.megatron_shapes import (
    DropoutInside,
    Propagation,
    Regroup,
    Shard,
    Unrecognised,
    shape_of,
)

aten = torch.ops.aten
_MOST_NODES = 400  # a pair's ops between; more means the values never meet a row matmul


@dataclass(frozen=True)
class Matmul:
    """A matmul by a 2-D parameter: `transposed` where the weight is (in, out) (addmm, mm)."""

    node: fx.Node
    x: fx.Node
    weight: fx.Node
    bias: fx.Node | None
    transposed: bool


def matmul(node: fx.Node) -> Matmul | None:
    if node.op != "call_function":
        return None
    args = node.args
    if node.target is aten.linear.default:
        x, weight, bias, transposed = args[0], args[1], (args[2] if len(args) > 2 else None), False
    elif node.target is aten.addmm.default and not node.kwargs:
        bias, x, weight, transposed = args[0], args[1], args[2], True
    elif node.target is aten.mm.default:
        x, weight, bias, transposed = args[0], args[1], None, True
    else:
        return None
    if not isinstance(x, fx.Node) or not _is_state(weight) or len(shape_of(weight)) != 2:
        return None
    if bias is not None and not _is_state(bias):
        return None
    return Matmul(node, x, weight, bias, transposed)


def _is_state(value: object) -> TypeGuard[fx.Node]:
    return isinstance(value, fx.Node) and value.op == "get_attr"


def find_blocks(gm: fx.GraphModule, layers: tuple[Layer, ...], degree: int) -> TensorParallel:
    """Every pair of `gm` sharded over `degree` ranks; the column matmuls no pair took, with why."""
    layer_of = {name: i for i, layer in enumerate(layers) for name in layer.nodes}
    uses = _state_uses(gm)
    blocks: list[ShardedBlock] = []
    taken: set[fx.Node] = set()
    reasons: list[str] = []
    for node in gm.graph.nodes:
        seed = matmul(node)
        if seed is None or node in taken:
            continue
        try:
            block, used = _block(seed, degree, layer_of, uses)
        except Unrecognised as why:
            reasons.append(f"{node.name}: {why}")
            continue
        except DropoutInside as where:
            raise OptionError(f"tensor_parallel={degree}: dropout with p > 0 at {where} lies between a pair of "
                              "sharded matmuls, where each rank would need a random stream of its own (not "
                              "supported yet); set that dropout to 0, or give tensor_parallel=1") from None
        if used & taken:  # two pairs would share nodes: the first keeps them, this one stays whole
            reasons.append(f"{node.name}: it shares values with an earlier pair")
            continue
        blocks.append(block)
        taken |= used
    return TensorParallel(degree, tuple(blocks), tuple(r for r in reasons if not _inside(r, taken)))


def _inside(reason: str, taken: set[fx.Node]) -> bool:
    """A matmul that failed as a pair's start but ended up in a pair (its row) needs no reason."""
    return reason.split(":")[0] in {n.name for n in taken}


def _state_uses(gm: fx.GraphModule) -> dict[str, int]:
    """Per state name, the uses of its tensor under any name (a tie read under two names counts twice)."""
    tensors = {str(n.target): id(attribute(gm, str(n.target))) for n in gm.graph.nodes if n.op == "get_attr"}
    counts: dict[int, int] = {}
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            counts[tensors[str(node.target)]] = counts.get(tensors[str(node.target)], 0) + len(node.users)
    return {name: counts[key] for name, key in tensors.items()}


def _block(seed: Matmul, degree: int, layer_of: dict[str, int],
           uses: dict[str, int]) -> tuple[ShardedBlock, set[fx.Node]]:
    columns, members, row = _region(seed)
    order = {n: i for i, n in enumerate(seed.node.graph.nodes)}
    groups = 1
    while True:
        propagation = Propagation(degree)
        try:
            for column in columns:
                propagation.shards[column.node] = Shard(len(shape_of(column.node)) - 1, groups)
            for node in sorted(members, key=order.__getitem__):
                propagation.visit(node)
            break
        except Regroup as regroup:
            if groups != 1:
                raise Unrecognised("its values split into groups twice") from None
            groups = regroup.groups
    expected = Shard(len(shape_of(row.x)) - 1)
    if propagation.shards.get(row.x) != expected:
        raise Unrecognised(f"{row.node.name} does not contract over the split")
    parameters = _parameters(columns, row, groups, degree, uses)
    nodes = {c.node for c in columns} | members | {row.node}
    held = {layer_of.get(n.name, -1) for n in nodes}
    if len(held) != 1 or -1 in held:
        raise Unrecognised("the pair spans layers")
    block = ShardedBlock(held.pop(), tuple(c.node.name for c in columns), row.node.name, parameters,
                         tuple(propagation.edits))
    return block, nodes


def _region(seed: Matmul) -> tuple[list[Matmul], set[fx.Node], Matmul]:
    """The column matmuls, the nodes between them and the row, and the row: the values followed
    from the columns until each reaches the one row matmul."""
    columns, members, rows = [seed], set(), set()
    frontier = [seed.node]
    while frontier:
        node = frontier.pop()
        for user in node.users:
            found = matmul(user)
            if found is not None and found.x is node and found.node not in {c.node for c in columns}:
                rows.add(found.node)
            elif user.op == "output":
                raise Unrecognised(f"{node.name} is returned before any row matmul")
            elif user not in members and user not in {c.node for c in columns}:
                members.add(user)
                frontier.append(user)
        for argument in (node.all_input_nodes if node in members else ()):
            other = _column_above(argument, seed.x, members)
            if other is not None and other.node not in {c.node for c in columns}:
                columns.append(other)
                frontier.append(other.node)
        if len(members) > _MOST_NODES:
            raise Unrecognised("its values never meet a row matmul")
    if len(rows) != 1:
        raise Unrecognised(f"it ends in {len(rows)} row matmuls, not one")
    row = matmul(rows.pop())
    assert row is not None
    return columns, members, row


def _column_above(node: fx.Node, x: fx.Node, members: set[fx.Node]) -> Matmul | None:
    """A matmul of the pair's input `x` that `node` (outside the region so far) comes from: k and v
    reach attention beside q."""
    seen: set[fx.Node] = set()
    stack = [node]
    while stack and len(seen) < _MOST_NODES:
        current = stack.pop()
        if current in seen or current in members or current is x:
            continue
        seen.add(current)
        found = matmul(current)
        if found is not None:
            if found.x is x:
                return found
            continue
        stack.extend(current.all_input_nodes)
    return None


def _parameters(columns: list[Matmul], row: Matmul, groups: int, degree: int,
                uses: dict[str, int]) -> tuple[ShardedParameter, ...]:
    """Column weights and biases split by output features, the row weight by input features; its
    bias stays whole (added once, after the all-reduce)."""
    found = []
    for column in columns:
        found.append(ShardedParameter(str(column.weight.target), Placement.COLUMN, int(column.transposed), groups))
        if column.bias is not None:
            found.append(ShardedParameter(str(column.bias.target), Placement.COLUMN, 0, groups))
    found.append(ShardedParameter(str(row.weight.target), Placement.ROW, int(not row.transposed)))
    nodes = {p.name: n for m in (*columns, row) for n in (m.weight, m.bias) if n is not None for p in found
             if p.name == n.target}
    for parameter in found:
        size = shape_of(nodes[parameter.name])[parameter.dim]
        if size % (parameter.groups * degree):
            raise Unrecognised(f"{parameter.name}'s {size} features do not divide by {parameter.groups * degree}")
        if uses.get(parameter.name, 0) != 1:
            raise Unrecognised(f"{parameter.name} is used elsewhere too (tied or shared)")
    return tuple(found)
