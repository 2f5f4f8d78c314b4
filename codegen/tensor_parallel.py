"""A stage module made one rank's part of its tensor-parallel group (ir/tensor_parallel.py).

The plan's blocks are applied to the stage's graph, so the generated code shows the collectives:
`tp_enter = tp_enter(x)` before a block's column matmuls (f), `tp_all_reduce(...)` after its row
matmul (g) with the row's bias added after the sum (`addmm` becomes `mm`), and the literal sizes
of the full model made this rank's. The sharded parameters are replaced by this rank's slices.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from stagewise.ir.tensor_parallel import ShardedBlock, SizeEdit, TensorParallel
from stagewise.ir.tensor_parallel_ops import tp_all_reduce, tp_enter

aten = torch.ops.aten


def shard_stage(module: fx.GraphModule, parallel: TensorParallel, rank: int) -> fx.GraphModule:
    """`module` (changed in place and returned) as rank `rank` of the stage's group runs it."""
    nodes = {n.name: n for n in module.graph.nodes}
    blocks = [b for b in parallel.blocks if b.row in nodes]
    for block in blocks:
        _shard_parameters(module, block, rank, parallel.degree)
        for edit in block.edits:
            _apply(nodes[edit.node], edit)
        _enter(module.graph, [nodes[c] for c in block.columns])
        _reduce(module.graph, nodes[block.row])
    if blocks:
        module.graph.lint()
        module.recompile()
    return module


def _shard_parameters(module: fx.GraphModule, block: ShardedBlock, rank: int, degree: int) -> None:
    for parameter in block.parameters:
        owner_name, _, leaf = parameter.name.rpartition(".")
        owner = module.get_submodule(owner_name)
        full = getattr(owner, leaf)
        shard = parameter.shard_of(full.detach(), rank, degree)
        setattr(owner, leaf, torch.nn.Parameter(shard, requires_grad=full.requires_grad))


def _apply(node: fx.Node, edit: SizeEdit) -> None:
    args = list(node.args)
    if edit.index < 0:
        args[edit.argument] = edit.value
    else:
        given = args[edit.argument]
        assert isinstance(given, (list, tuple)), f"{node.name}: argument {edit.argument} is not a list of sizes"
        sizes = list(given)
        sizes[edit.index] = edit.value
        args[edit.argument] = sizes
    node.args = tuple(args)


def _enter(graph: fx.Graph, columns: list[fx.Node]) -> None:
    """f once on the columns' shared input (before the first of them), which every column then reads."""
    order = {node: index for index, node in enumerate(graph.nodes)}
    first = min(columns, key=order.__getitem__)
    position = 0 if first.target is not aten.addmm.default else 1
    x = first.args[position]
    assert isinstance(x, fx.Node), f"{first.name} multiplies a constant"
    with graph.inserting_before(first):
        entered = graph.call_function(tp_enter, (x,))
    for column in columns:
        column.replace_input_with(x, entered)


def _reduce(graph: fx.Graph, row: fx.Node) -> None:
    """g after the row matmul; its bias (summed once, not once per rank) added after it."""
    users = list(row.users)
    bias = None
    if row.target is aten.addmm.default:
        bias, x, weight = row.args
        row.target, row.args = aten.mm.default, (x, weight)
    elif row.target is aten.linear.default and len(row.args) > 2 and row.args[2] is not None:
        bias = row.args[2]
        row.args = row.args[:2]
    with graph.inserting_after(row):
        summed = graph.call_function(tp_all_reduce, (row,))
    result = summed
    if bias is not None:
        with graph.inserting_after(summed):
            result = graph.call_function(aten.add.Tensor, (summed, bias))
    for user in users:
        user.replace_input_with(row, result)
