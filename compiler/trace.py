"""Capture model + loss as one flat torch.fx graph whose nodes know their module path.

torch.fx symbolic tracing first (it keeps `call_module` leaves and reads like the model);
torch.export in non-strict mode when fx cannot (Hugging Face models), whose nodes carry
`nn_module_stack`. Either way the result is a GraphModule with one placeholder per model
input (plus `target`), parameters as `get_attr` nodes keyed by the original FQNs, and a
scalar loss as its only output.
"""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass

import torch
import torch.fx as fx
from stagewise.compiler.errors import ExampleInputsError, LossError, TraceError
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.passes.fake_tensor_prop import FakeTensorProp
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.flop_counter import FlopCounterMode


@dataclass
class Traced:
    graph_module: fx.GraphModule
    tracer: str  # "fx" | "export"
    input_names: list[str]
    input_kind: str  # "positional" | "keyword"
    target_name: str | None

    @property
    def graph_inputs(self) -> tuple[str, ...]:
        """Placeholder node names (fx renames an input called `input` to `input_1`)."""
        return tuple(n.name for n in self.graph_module.graph.nodes if n.op == "placeholder")


class Objective(torch.nn.Module):
    """The model's forward followed by its loss, sharing the model's own parameter dicts.

    Sharing `_modules`, `_parameters` and `_buffers` (rather than holding the model as a
    child) keeps every FQN and module path exactly as in the user's model.
    """

    def __init__(self, model: torch.nn.Module, loss_fn, keyword: bool):
        super().__init__()
        object.__setattr__(self, "model", model)
        object.__setattr__(self, "loss_fn", loss_fn)
        object.__setattr__(self, "keyword", keyword)
        object.__setattr__(self, "_modules", model._modules)
        object.__setattr__(self, "_parameters", model._parameters)
        object.__setattr__(self, "_buffers", model._buffers)

    def forward(self, inputs, target=None):
        out = self.model.forward(**inputs) if self.keyword else self.model.forward(*inputs)
        if self.loss_fn is not None:
            return self.loss_fn(out, target)
        if isinstance(out, torch.Tensor | fx.Proxy):
            return out
        loss = getattr(out, "loss", None)
        if loss is None and isinstance(out, dict):
            loss = out.get("loss")
        if loss is None:
            raise LossError(
                f"the model returns {type(out).__name__}, not a loss: pass loss_fn=(output, target) -> loss "
                "and example_target=, or make the model return a scalar loss (or an object with .loss)"
            )
        return loss


def input_names(model: torch.nn.Module, example_inputs) -> tuple[list[str], str]:
    """Names of the model inputs, and whether `step` takes them positionally or as keywords."""
    if isinstance(example_inputs, dict):
        if not all(isinstance(k, str) for k in example_inputs):
            raise ExampleInputsError("example_inputs dict keys must be the model's argument names (strings)")
        return list(example_inputs), "keyword"
    if isinstance(example_inputs, tuple):
        try:
            params = list(inspect.signature(model.forward).parameters.values())
        except (TypeError, ValueError):
            params = []
        names = [
            p.name if i < len(params) and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) else f"input_{i}"
            for i, p in zip(range(len(example_inputs)), params + [None] * len(example_inputs), strict=False)
        ]
        return names, "positional"
    raise ExampleInputsError(
        f"example_inputs must be a tuple of positional arguments or a dict of keyword arguments, "
        f"got {type(example_inputs).__name__}; for one tensor write example_inputs=(x,)"
    )


def trace(model: torch.nn.Module, example_inputs, example_target, loss_fn) -> Traced:
    """Trace `model` (+ `loss_fn`) on one microbatch of example inputs."""
    names, kind = input_names(model, example_inputs)
    objective = Objective(model, loss_fn, kind == "keyword")
    target_name = "target" if loss_fn is not None else None
    if target_name in names:
        target_name = "loss_target"
    buffers = {k: b.detach().clone() for k, b in model.named_buffers()}
    failures = []
    try:
        for tracer in (_trace_fx, _trace_export):
            try:
                gm = tracer(objective, example_inputs, example_target, len(names))
            except LossError:
                raise
            except Exception as err:  # noqa: BLE001 - every tracer failure is reported together
                failures.append(f"{tracer.__doc__.split(':')[0]}: {type(err).__name__}: {_first_line(err)}")
                continue
            traced = Traced(gm, "fx" if tracer is _trace_fx else "export", names, kind, target_name)
            _normalise(traced)
            annotate(traced.graph_module, example_inputs, example_target)
            _check_loss(traced.graph_module)
            return traced
    finally:
        with torch.no_grad():
            for k, b in model.named_buffers():
                b.copy_(buffers[k])
    raise TraceError(
        "could not capture the model as a graph.\n  "
        + "\n  ".join(failures)
        + "\nWhat to do: replace Python control flow that depends on tensor values (if x.sum() > 0:) "
        "with tensor operations (torch.where) or torch.cond, so that one graph describes every step."
    )


def _first_line(err: Exception) -> str:
    text = str(err).strip().splitlines()
    return text[0][:300] if text else ""


def _trace_fx(objective, example_inputs, example_target, n_inputs) -> fx.GraphModule:
    """torch.fx symbolic trace: keeps torch.nn leaves as call_module nodes."""
    structure = {k: fx.PH for k in example_inputs} if isinstance(example_inputs, dict) else (fx.PH,) * n_inputs
    tracer = fx.Tracer()
    graph = tracer.trace(objective, concrete_args={"inputs": structure})
    graph._codegen = fx.graph.CodeGen()
    return fx.GraphModule(tracer.root, graph, type(objective.model).__name__)


def _trace_export(objective, example_inputs, example_target, n_inputs) -> fx.GraphModule:
    """torch.export (non-strict): ATen graph, module paths from nn_module_stack."""
    args = (example_inputs, example_target) if objective.loss_fn is not None else (example_inputs,)
    # The same tensor passed twice (input_ids as labels) would become one graph input.
    args = tree_map(lambda v: v.clone() if isinstance(v, torch.Tensor) else v, args)
    program = torch.export.export(objective, args, strict=False)
    gm = program.module()
    for node in list(gm.graph.nodes):
        if node.op == "call_module" and node.target == "_guards_fn":
            gm.graph.erase_node(node)
    return gm


def _normalise(traced: Traced) -> None:
    """Plain codegen, placeholders named after the model's arguments, readable node names."""
    gm = traced.graph_module
    graph = gm.graph
    graph._codegen = fx.graph.CodeGen()
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    wanted = traced.input_names + ([traced.target_name] if traced.target_name else [])
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
    output.args = (flat[0],)
    for node in graph.nodes:
        node.meta["module_path"] = module_path(node)
        if node.op in ("call_function", "call_method"):
            base = re.sub(r"_\d+$", "", node.name)
            prefix = node.meta["module_path"].replace(".", "_")
            node._rename(f"{prefix}_{base}" if prefix and not base.startswith(prefix) else base)
    graph.eliminate_dead_code()
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


def annotate(gm: fx.GraphModule, example_inputs, example_target) -> None:
    """Fill node.meta['val'] (fake tensors) and node.meta['flops'] (forward FLOPs) for one microbatch."""
    inputs = list(example_inputs.values()) if isinstance(example_inputs, dict) else list(example_inputs)
    if example_target is not None and any(n.target == "target" or n.target == "loss_target" for n in gm.graph.nodes if n.op == "placeholder"):
        inputs.append(example_target)
    _CountingProp(gm, FakeTensorMode(allow_non_fake_inputs=True)).propagate(*inputs)


class _CountingProp(FakeTensorProp):
    """Fake-tensor shape propagation that also counts each node's forward FLOPs."""

    def run_node(self, n: fx.Node):
        if n.op not in ("call_function", "call_method", "call_module"):
            n.meta["flops"] = 0
            return super().run_node(n)
        counter = FlopCounterMode(display=False)
        with counter:
            result = super().run_node(n)
        n.meta["flops"] = int(counter.get_total_flops())
        return result


def _check_loss(gm: fx.GraphModule) -> None:
    (output,) = [n for n in gm.graph.nodes if n.op == "output"]
    value = output.args[0].meta.get("val") if isinstance(output.args[0], fx.Node) else output.args[0]
    if not isinstance(value, torch.Tensor) or value.numel() != 1 or not value.is_floating_point():
        shape = list(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        raise LossError(
            f"the model's output has shape {shape} (for one microbatch), not a scalar loss: pass loss_fn=(output, target) -> loss "
            "and example_target=, or make the model return its loss"
        )
