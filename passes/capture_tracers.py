"""The two tracers the capture tries in turn, and the normalisation their graphs share.

torch.fx symbolic tracing first (it keeps `call_module` leaves and reads like the model);
torch.export in non-strict mode when fx cannot (Hugging Face models, a forward that switches grad
mode: fx would drop a `torch.no_grad()` block), whose nodes carry `nn_module_stack`. Both take (objective, example inputs, example target, number of inputs,
dynamic) and give a GraphModule, with what torch.export says about it for the second.
"""

from __future__ import annotations

import contextlib
import re
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch.fx.experimental import proxy_tensor
from torch.utils._pytree import tree_flatten, tree_map

from stagewise.ir.errors import TraceError
from stagewise.passes.capture_functional import modifies_input
from stagewise.passes.capture_grad_regions import inline_grad_regions
from stagewise.passes.model_output import mark_output


@dataclass
class Exported:
    """What torch.export says about the graph's inputs: their guards, the symbols' ranges, and
    whether any input size stayed symbolic (Dim.AUTO leaves a size static where the model pins it)."""

    guards: Callable | None
    ranges: dict
    symbolic: bool


def trace_fx(objective, example_inputs, example_target, n_inputs, dynamic=False) -> tuple[fx.GraphModule, None]:
    """torch.fx symbolic trace: keeps torch.nn leaves as call_module nodes."""
    structure = {k: fx.PH for k in example_inputs} if isinstance(example_inputs, dict) else (fx.PH,) * n_inputs
    tracer = fx.Tracer()
    with torch.enable_grad(), _grad_mode_changes() as changes:
        graph = tracer.trace(objective, concrete_args={"inputs": structure})
    if changes:
        raise TraceError("the model turns autograd off or on in its forward (torch.no_grad(), "
                         "torch.set_grad_enabled), which a torch.fx trace cannot record")
    graph._codegen = fx.graph.CodeGen()
    return fx.GraphModule(tracer.root, graph, type(objective._stagewise_model).__name__), None




@contextlib.contextmanager
def _grad_mode_changes() -> Iterator[list[bool]]:
    """The grad modes this thread switches to inside (torch.no_grad, enable_grad and
    set_grad_enabled all set it through torch._C._set_grad_enabled): fx would drop such a block
    silently, its weights then trained through it; torch.export keeps it as a region."""
    changes: list[bool] = []
    original, thread = torch._C._set_grad_enabled, threading.get_ident()

    def recording(enabled: bool) -> None:
        if threading.get_ident() == thread and enabled != torch.is_grad_enabled():
            changes.append(enabled)
        original(enabled)

    torch._C._set_grad_enabled = recording
    try:
        yield changes
    finally:
        torch._C._set_grad_enabled = original


def trace_export(objective, example_inputs, example_target, n_inputs, dynamic=False) -> tuple[fx.GraphModule, Exported]:
    """torch.export (non-strict): ATen graph, module paths from nn_module_stack. The objective
    returns (loss, the model output's tensors) while exported: `normalise` marks them and keeps the loss.

    `dynamic`: every dimension of every input is `Dim.AUTO`, a symbol unless the model pins it (a
    weight's size, a literal); an export that fails that way is retried with static shapes."""
    args = (example_inputs, example_target) if objective._stagewise_loss_fn is not None else (example_inputs,)
    # The same tensor passed twice (input_ids as labels) would become one graph input.
    args = tree_map(lambda v: v.clone() if isinstance(v, torch.Tensor) else v, args)
    batched = [v for v in tree_flatten(args)[0] if isinstance(v, torch.Tensor) and v.dim() > 0]
    with _returning_output(objective):
        program = _export(objective, args, batched, dynamic)
    _forget_export_nodes()
    gm = program.module()
    guards = getattr(gm, "_guards_fn", None)
    for node in list(gm.graph.nodes):
        if node.op == "call_module" and node.target == "_guards_fn":
            gm.graph.erase_node(node)
    inline_grad_regions(gm)
    symbolic = any(isinstance(size, torch.SymInt) and size.node.expr.free_symbols
                   for n in gm.graph.nodes if n.op == "placeholder" and isinstance(n.meta.get("val"), torch.Tensor)
                   for size in n.meta["val"].shape)
    return gm, Exported(guards, dict(program.range_constraints), bool(symbolic))


def _export(objective, args: tuple, batched: list, dynamic: bool):
    """The exported program: every dimension `Dim.AUTO` when `dynamic` (export pins a size of 1, 0/1
    specialisation, and keeps the others symbolic), static where that fails.

    Exported with grad enabled whatever the caller's mode: export keeps a `torch.no_grad()` block
    of the model as a region only where it differs from the mode it traces under, and drops it
    otherwise (compiled under no_grad, the block's weights got gradients)."""
    if dynamic and batched:
        shapes = tree_map(lambda v: dict.fromkeys(range(v.dim()), torch.export.Dim.AUTO)
                          if isinstance(v, torch.Tensor) and v.dim() > 0 else None, args)
        with contextlib.suppress(Exception), _no_stack_traces(), _no_fake_tensor_cache(), torch.enable_grad():
            return torch.export.export(objective, args, dynamic_shapes=shapes, strict=False)
    with _no_stack_traces(), _no_fake_tensor_cache(), torch.enable_grad():
        return torch.export.export(objective, args, strict=False)


@contextlib.contextmanager
def _returning_output(objective):
    object.__setattr__(objective, "_stagewise_with_output", True)
    try:
        yield
    finally:
        object.__setattr__(objective, "_stagewise_with_output", False)


def _forget_export_nodes() -> None:
    """torch.export keeps, until the next export, a map from its fake tensors to the nodes of the
    graph it traced, which it reads only within that export (its fake-tensor leak check): the
    whole traced graph (1.1 MB for a 4-layer GPT-2) stayed alive after the pipeline was dropped.
    A torch without that map (another version) keeps nothing there."""
    nodes_of_fakes = getattr(proxy_tensor, "_FAKE_TENSOR_ID_TO_PROXY_MAP_FOR_EXPORT", None)
    if nodes_of_fakes is not None:
        nodes_of_fakes.clear()


@contextlib.contextmanager
def _no_stack_traces():
    """torch.export records a Python stack trace for every node (a fifth of its time); nothing
    here reads them. Older torch (2.11) lacks the switch: its exports keep their traces."""
    config = torch.fx.config
    if not hasattr(config, "do_not_emit_stack_traces"):
        yield
        return
    before = config.do_not_emit_stack_traces
    config.do_not_emit_stack_traces = True
    try:
        yield
    finally:
        config.do_not_emit_stack_traces = before


@contextlib.contextmanager
def _no_fake_tensor_cache():
    """Export's fake tensors without torch's dispatch cache: one export meets a repeated op only a few
    times, and under symbolic sizes a hit rebuilds the output's sizes and strides by symbolic arithmetic,
    which cost more than the op (bench/export_cache.py: TinyGPT's export 30% less CPU, GPT-2 and Llama
    10-16%, BERT 5% more; the graph the same but for its nodes' numbering). Read when export makes its
    FakeTensorMode: the capture's own modes keep the cache."""
    config = torch._dynamo.config
    if not hasattr(config, "fake_tensor_cache_enabled"):
        yield
        return
    with config.patch(fake_tensor_cache_enabled=False):
        yield


def normalise(gm: fx.GraphModule, wanted: list[str]) -> None:
    """Plain codegen, placeholders named after the model's arguments (`wanted`), readable node names."""
    graph = gm.graph
    graph._codegen = fx.graph.CodeGen()
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    # fx's pytree placeholders hold a default of PH; unused ones (target=None) are dropped.
    for node in placeholders[len(wanted) :]:
        if node.users:
            raise TraceError(f"unexpected extra graph input {node.name}")
        graph.erase_node(node)
    for node, name in zip(placeholders, wanted, strict=False):
        node.target = name
        node.args = ()
        node._rename(name)
    (output,) = [n for n in graph.nodes if n.op == "output"]
    flat, _ = tree_flatten(output.args[0])
    for ordinal, node in enumerate(flat[1:]):  # (loss, the model output's tensors): what pipe.predict returns
        if isinstance(node, fx.Node):
            mark_output(node, ordinal)
    output.args = (flat[0],)
    for node in graph.nodes:
        node.meta["module_path"] = module_path(node)
        if node.op in ("call_function", "call_method"):
            base = re.sub(r"_\d+$", "", node.name)
            prefix = node.meta["module_path"].replace(".", "_")
            node._rename(f"{prefix}_{base}" if prefix and not base.startswith(prefix) else base)
    graph.eliminate_dead_code(lambda n: n.is_impure() or modifies_input(gm, n))
    graph.lint()
    gm.recompile()


def module_path(node: fx.Node) -> str:
    """The FQN of the innermost module whose forward made this node ('' for the root)."""
    if node.op == "call_module":
        return str(node.target)
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    path = list(stack.values())[-1][0]
    # export prefixes paths of modules reached through the root as L['self'].x or similar
    return re.sub(r"^L\['self'\]\.?", "", path)
