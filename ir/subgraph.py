"""Cut a set of nodes out of the whole-model graph as a GraphModule of its own.

Used for stage modules (codegen) and for the profiler's single-layer modules: placeholders for
the values the nodes receive, `get_attr` and `call_module` for their state under the original
FQNs, and the chosen values returned as a tuple. The state is deep-copied in one call, so a
tensor used twice inside the subgraph (a tie not split by the cut) stays one tensor.

The model is traced on one device (the CPU, mostly) and torch.export writes that device into the
ops that make tensors (`arange(..., device=cpu)` for position ids). An extracted module runs where
its stage is placed, so those ops read the device from the module's first tensor input or state
instead (`bind_device`): the generated code is the same on every device.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable

import torch
import torch.fx as fx

MODEL_OUTPUT = "stagewise_model_output"  # node meta: the model's output (loss_fn's first argument, or .logits)
LAYER_NAME = "stagewise_layer"  # node meta: the layer a saved graph's node was in (compiler/compile/model_graph.py)


def extract(gm: fx.GraphModule, nodes: Iterable[str], inputs: Iterable[str], outputs: Iterable[str],
            class_name: str) -> fx.GraphModule:
    by_name = {n.name: n for n in gm.graph.nodes}
    members = set(nodes)
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {by_name[name]: graph.placeholder(name) for name in inputs}
    attrs: dict[str, object] = {}
    for node in gm.graph.nodes:
        if node.name not in members:
            continue
        for arg in node.all_input_nodes:
            if arg.op == "get_attr" and arg not in env:
                env[arg] = graph.node_copy(arg)
                attrs[arg.target] = attribute(gm, arg.target)
        if node.op == "call_module":
            attrs[node.target] = gm.get_submodule(node.target)
        env[node] = graph.node_copy(node, lambda n: env[n])
    graph.output(tuple(env[by_name[name]] for name in outputs))
    tensor_inputs = [env[by_name[name]] for name in inputs if isinstance(by_name[name].meta.get("val"), torch.Tensor)]
    bind_device(graph, tensor_inputs, attrs)
    return fx.GraphModule(copy.deepcopy(attrs), graph, class_name=class_name)


def bind_device(graph: fx.Graph, tensor_inputs: list[fx.Node], attrs: dict[str, object]) -> None:
    """Ops given a fixed device (`device=` or positional, as `aten.to.device`) make their tensors on
    the device of the module's first tensor input (or, with none, of its first tensor attribute) as
    it runs. A module with neither keeps them."""
    fixed = [n for n in graph.nodes if n.op == "call_function"
             and any(isinstance(a, torch.device) for a in (*n.args, *n.kwargs.values()))]
    if not fixed:
        return
    if tensor_inputs:
        anchor = tensor_inputs[0]
    else:
        state = next((target for target, value in attrs.items() if isinstance(value, torch.Tensor)), None)
        if state is None:
            return
        with graph.inserting_before(fixed[0]):
            anchor = graph.get_attr(state)
    with graph.inserting_before(fixed[0]):
        device = graph.create_node("call_function", getattr, (anchor, "device"), name="stage_device")
    for node in fixed:
        node.args = tuple(device if isinstance(a, torch.device) else a for a in node.args)
        node.kwargs = {k: device if isinstance(v, torch.device) else v for k, v in node.kwargs.items()}


def attribute(root: torch.nn.Module, target: str):
    """`root.a.b.c` for target 'a.b.c'."""
    obj = root
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj
