"""Symbolic sizes computed where they are used, so the stage code of a dynamic export takes any shape.

torch.export with symbolic sizes reads each size once (`sym_size_int = aten.sym_size.int(input_ids, 1)`
at the top of the graph) and every `view`, `reshape`, `expand` and `arange` of every block uses that
one node. Cut into stages, such a node would cross every cut as a Python int: the cuts would be
illegal (passes/cutpoints.py), or, folded into literals, the stage code would hold the example's
sizes. Here every run of nodes that becomes a layer (passes/layers.py `layer_runs`) reads the sizes
it uses itself, from the graph inputs (placeholders) they were bound from: a stage takes a graph
input as any stage does (the feed gives it to every stage that reads it; nothing is sent), and the
generated code reads `sym_size_int = torch.ops.aten.sym_size.int(input_ids, 1)` before its views.
Size arithmetic (`s0 * s1`) is copied with them. Export's run-time assertions on sizes (a symbol's
range) are left to the step's check of its inputs (compiler/assembly/step_shapes.py) and dropped.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from stagewise.passes.layers import layer_runs

SYMBOLIC = (torch.SymInt, torch.SymFloat, torch.SymBool)
# Run-time assertions on symbolic sizes (checked by the capture at each size, then dropped).
ASSERTS = {
    torch.ops.aten._assert_scalar.default,
    torch.ops.aten.sym_constrain_range.default,
    torch.ops.aten.sym_constrain_range_for_size.default,
}


def is_size(node: fx.Node) -> bool:
    """A node whose value is a symbolic size (or arithmetic on sizes)."""
    return isinstance(node.meta.get("val"), SYMBOLIC)


def localise_sizes(gm: fx.GraphModule, model: torch.nn.Module) -> None:
    """Give each layer-to-be its own copy of every size node it uses (see the module docstring)."""
    graph = gm.graph
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target in ASSERTS:
            graph.erase_node(node)
    for _, nodes in layer_runs(gm, model):
        copies: dict[fx.Node, fx.Node] = {}
        for user in [n for n in nodes if not is_size(n)]:
            used = [a for a in user.all_input_nodes if is_size(a)]
            for size in used:
                if size not in copies:
                    with graph.inserting_before(user):
                        copies[size] = _copy_size(graph, size, copies, user.meta.get("module_path", ""))
                user.replace_input_with(size, copies[size])
    graph.eliminate_dead_code()
    graph.lint()
    gm.recompile()


def _copy_size(graph: fx.Graph, size: fx.Node, copies: dict[fx.Node, fx.Node], path: str) -> fx.Node:
    """`size` recomputed from its inputs' copies (placeholders are used as they are)."""
    for arg in size.all_input_nodes:
        if is_size(arg) and arg not in copies:
            copies[arg] = _copy_size(graph, arg, copies, path)
    copy = graph.node_copy(size, lambda n: copies.get(n, n))
    copy.meta = dict(size.meta, module_path=path)
    if copy.target is torch.ops.aten.sym_size.int:
        source, dim = copy.args
        assert isinstance(source, fx.Node), copy  # sym_size.int reads the size of a tensor node
        copy._rename(f"{source.name}_size_{dim}")  # fx appends _1, _2 to repeats
    return copy
