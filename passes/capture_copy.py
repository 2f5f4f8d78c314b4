"""The capture's template copied into a graph of its own, for one microbatch size: the copy's nodes
take that size's values and FLOPs (passes/capture.py), its module holds the template's own parameters
and buffers (never copies: graphs at different sizes train the same weights).
"""

from __future__ import annotations

import torch
import torch.fx as fx


def copy_graph(template: fx.GraphModule) -> fx.Graph:
    """The template's graph copied, node meta copied shallowly (values of one size are set on the copy)."""
    graph = fx.Graph()
    graph.output(graph.graph_copy(template.graph, {}))
    return graph


def copied(template: fx.GraphModule) -> fx.GraphModule:
    """The template as a module of its own: values of one size set on it leave the template's alone."""
    return module_of(template, copy_graph(template))


def module_of(template: fx.GraphModule, graph: fx.Graph) -> fx.GraphModule:
    """A GraphModule of `graph` holding the template's own parameters, buffers and submodules,
    every name of them included (also those the graph does not use: tied weights' other names)."""
    gm = fx.GraphModule(template, graph, class_name=type(template).__name__)
    for name, tensor in [*template.named_parameters(remove_duplicate=False),
                         *template.named_buffers(remove_duplicate=False)]:
        *path, leaf = name.split(".")
        owner, source = gm, template
        for part in path:
            source = getattr(source, part)
            if not hasattr(owner, part):
                owner.add_module(part, torch.nn.Module())
            owner = getattr(owner, part)
        if hasattr(owner, leaf):
            continue
        if isinstance(tensor, torch.nn.Parameter):
            owner.register_parameter(leaf, tensor)
        else:
            owner.register_buffer(leaf, tensor, persistent=leaf not in source._non_persistent_buffers_set)
    return gm
