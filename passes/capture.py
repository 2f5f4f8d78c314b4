"""Capture model + loss as one flat torch.fx graph whose nodes know their module path.

torch.fx symbolic tracing first (it keeps `call_module` leaves and reads like the model);
torch.export in non-strict mode when fx cannot (Hugging Face models), whose nodes carry
`nn_module_stack`. Either way the result is a GraphModule with one placeholder per model
input (plus `target`), parameters as `get_attr` nodes keyed by the original FQNs, and a
scalar loss as its only output.

A model is captured once (`capture`), and the graph at any microbatch size comes from that one
capture (`Capture.at`): the planner weighs several microbatch counts.

- an fx graph is shape-agnostic (sizes are computed by the graph itself); at a size it is
  copied and fake tensors are propagated through it (node.meta['val'], ['flops']), a torch.nn
  leaf module repeated with the same configuration and input shapes run only once;
- torch.export (`dynamic=True`) is asked for a graph whose input sizes are symbols (`Dim.AUTO`
  on every dimension of every input: batch, sequence length, image size; export keeps literal
  what the model pins, a weight's width). The size nodes are then read in each layer that uses
  them, from the graph inputs (passes/local_sizes.py), so the generated stage code takes any
  shape. At a size the graph is copied with the symbols bound: every node's value is the
  export's own symbolic value evaluated there, FLOPs come from torch.utils.flop_counter's
  formulas on those shapes.

A size the symbolic graph does not cover is exported again, statically, at that size: the
model cannot keep its batch symbolic (export specialised it: `if x.shape[0] == 4`, a
data-dependent shape), the example batch is 1, or the size fails the export's own range
constraints and guards. Size 1 is special: export assumes a symbolic size is at least 2
(0/1 specialisation) yet accepts 1 at run time; a model whose Python code branches on a
batch of one would then differ from eager, so at size 1 the graph is used only after one
forward of it gives eager's loss on the same inputs (else it is exported at size 1). What a
step may give follows (`lowest_sizes`, `smallest_microbatch`): compiler/assembly/batches.py checks it.

The parts live beside this module: capture_tracers (the two tracers and the normalisation of
their graphs), symbolic_sizes (binding and evaluating the symbolic sizes), local_sizes (sizes read where used),
capture_annotate (node values and FLOPs by fake-tensor propagation, FLOPs of an ATen node),
capture_copy (the template copied into a graph of one size's own), capture_functional (in-place
ops written out of place where no alias can tell).
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.node import map_arg
from torch.utils._pytree import tree_flatten

from stagewise.ir.errors import ExampleInputsError, LossError, TraceError
from stagewise.passes.capture_annotate import annotate, check_loss, op_flops
from stagewise.passes.capture_copy import copied, copy_graph, module_of
from stagewise.passes.capture_functional import functionalize
from stagewise.passes.capture_tracers import Exported, normalise, trace_export, trace_fx
from stagewise.passes.local_sizes import localise_sizes
from stagewise.passes.model_output import OutputStructure, flatten_output, mark_output
from stagewise.passes.symbolic_sizes import Evaluator, NotCovered, bind

# (Traced.tracer, the name failures are reported under, the tracer), tried in this order
_TRACERS = (("fx", "torch.fx symbolic trace", trace_fx), ("export", "torch.export (non-strict)", trace_export))


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
    child) keeps every FQN and module path exactly as in the user's model. Its own attributes
    carry a prefix no model uses (read them as they are, no properties): an attribute `model`
    would shadow a submodule named `model` (Llama's, Mistral's, BART's), and torch.export finds
    submodules by attribute.
    """

    # set with object.__setattr__ (below): declared for the type checker, which reads nn.Module's
    # __getattr__ (a tensor or a submodule) for any attribute not declared
    _stagewise_model: torch.nn.Module
    _stagewise_loss_fn: Callable[..., Any] | None
    _stagewise_keyword: bool
    _stagewise_with_output: bool
    _stagewise_output: list[OutputStructure]

    def __init__(self, model: torch.nn.Module, loss_fn, keyword: bool):
        super().__init__()
        object.__setattr__(self, "_stagewise_model", model)
        object.__setattr__(self, "_stagewise_loss_fn", loss_fn)
        object.__setattr__(self, "_stagewise_keyword", keyword)
        object.__setattr__(self, "_stagewise_with_output", False)  # torch.export: return (loss, output)
        # the model output's structure once traced, filled in place (torch.export puts back a copy of it)
        object.__setattr__(self, "_stagewise_output", [])
        object.__setattr__(self, "_modules", model._modules)
        object.__setattr__(self, "_parameters", model._parameters)
        object.__setattr__(self, "_buffers", model._buffers)

    def forward(self, inputs, target=None):
        model = self._stagewise_model
        out = model.forward(**inputs) if self._stagewise_keyword else model.forward(*inputs)
        if self._stagewise_loss_fn is not None:
            return self._with_output(self._stagewise_loss_fn(out, target), out)
        if isinstance(out, torch.Tensor | fx.Proxy):
            return self._with_output(out, out)
        loss = getattr(out, "loss", None)
        if loss is None and isinstance(out, dict):
            loss = out.get("loss")
        if loss is None:
            raise LossError(
                f"the model returns {type(out).__name__}, not a loss: pass loss_fn=(output, target) -> loss "
                "and example_target=, or make the model return a scalar loss (or an object with .loss)"
            )
        return self._with_output(loss, out)

    def _with_output(self, loss, output):
        """The loss, having recorded the structure of the model's `output` (what `pipe.predict` returns,
        passes/model_output.py) and marked its tensors: fx's proxies directly; under torch.export
        (loss, its tensors), which the capture marks as it keeps the loss (capture_tracers.normalise)."""
        structure, tensors = flatten_output(output, loss)
        self._stagewise_output[:] = [structure]
        if self._stagewise_with_output:
            return loss, tuple(tensors)
        for ordinal, tensor in enumerate(tensors):
            if isinstance(tensor, fx.Proxy):
                mark_output(tensor.node, ordinal)
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
        by_position = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        names = [
            params[i].name if i < len(params) and params[i].kind in by_position else f"input_{i}"
            for i in range(len(example_inputs))
        ]
        return names, "positional"
    raise ExampleInputsError(
        f"example_inputs must be a tuple of positional arguments or a dict of keyword arguments, "
        f"got {type(example_inputs).__name__}; for one tensor write example_inputs=(x,)"
    )


def trace(model: torch.nn.Module, example_inputs, example_target, loss_fn) -> Traced:
    """Trace `model` (+ `loss_fn`) on one microbatch of example inputs (one size: static export)."""
    return capture(model, example_inputs, example_target, loss_fn).at(example_inputs, example_target)


def capture(model: torch.nn.Module, example_inputs, example_target, loss_fn, *, dynamic: bool = False) -> Capture:
    """Capture `model` (+ `loss_fn`) once, on example inputs; `Capture.at` gives the graph at any size.

    `dynamic`: export with a symbolic batch dimension, so that every size comes from this one
    export. Such an export costs about 2x a static one (symbolic shape arithmetic in every op),
    so ask for it when more than one size will be needed; fx tracing is shape-agnostic anyway.
    """
    names, kind = input_names(model, example_inputs)
    objective = Objective(model, loss_fn, kind == "keyword")
    traced_output = objective._stagewise_output  # torch.export puts back a copy of it: keep the one it fills
    target_name = "target" if loss_fn is not None else None
    if target_name in names:
        target_name = "loss_target"
    wanted = names + ([target_name] if target_name else [])
    failures = []
    with _buffers_kept(model):
        for tracer_name, label, tracer in _TRACERS:
            try:
                gm, exported = tracer(objective, example_inputs, example_target, len(names), dynamic)
            except LossError:
                raise
            except Exception as err:  # noqa: BLE001 - every tracer failure is reported together
                failures.append(f"{label}: {type(err).__name__}: {_first_line(err)}")
                continue
            normalise(gm, wanted)
            if exported is not None and exported.symbolic:
                localise_sizes(gm, model)
            return Capture(objective, tracer_name, names, kind, target_name, gm, exported, traced_output)
    raise TraceError(
        "could not capture the model as a graph.\n  "
        + "\n  ".join(failures)
        + "\nWhat to do: replace Python control flow that depends on tensor values (if x.sum() > 0:) "
        "with tensor operations (torch.where) or torch.cond, so that one graph describes every step."
    )


class Capture:
    """One capture of model + loss: a graph template, and the graph at any microbatch size.

    The template is normalised (placeholders named after the model's arguments, readable node
    names) but has no values of its own size: `at` copies it, so graphs at different sizes
    share the model's parameters and nothing else.
    """

    def __init__(self, objective: Objective, tracer: str, names: list[str], kind: str, target_name: str | None,
                 template: fx.GraphModule, exported: Exported | None, traced_output: list | None = None):
        self.objective, self.tracer, self.template, self.exported = objective, tracer, template, exported
        self.traced_output: list[OutputStructure] = traced_output or []  # Objective's, filled as it was traced
        self.input_names, self.input_kind, self.target_name = names, kind, target_name
        self.exports = 1 if exported is not None else 0  # graphs exported so far
        self.flop_memo: dict[str, int] = {}

    def at(self, inputs, target) -> Traced:
        """The graph at the microbatch size of `inputs` (and `target`), with node.meta['val'] and
        ['flops'] at that size."""
        with _buffers_kept(self.objective._stagewise_model):
            gm = self._graph_at(inputs, target)
        return Traced(gm, self.tracer, self.input_names, self.input_kind, self.target_name)

    def model_output(self, gm: fx.GraphModule) -> tuple[str | None, tuple[str | None, ...]]:
        """The model output's structure as pytree JSON, and per leaf the node of `gm` (a graph of this
        capture) computing it: what `pipe.predict` returns (passes/model_output.py)."""
        if not self.traced_output:
            return None, ()
        return self.traced_output[0].described(), self.traced_output[0].node_names(gm)

    def lowest_sizes(self) -> list[tuple[int, ...]] | None:
        """Per graph input, the smallest each size after the batch dimension may be at run time: an
        export's symbolic size its range's lower bound (2: export assumes a symbolic size is not 1), a
        size it fixed only its traced size. None for an fx graph: it computes its sizes itself."""
        if self.tracer == "fx":
            return None
        result = []
        for node in self.template.graph.nodes:
            if node.op != "placeholder":
                continue
            value = node.meta.get("val")
            shape = tuple(value.shape[1:]) if isinstance(value, torch.Tensor) and value.dim() else ()
            result.append(tuple(self._lowest(size) for size in shape))
        return result

    def _lowest(self, size) -> int:
        expr = size.node.expr if isinstance(size, torch.SymInt) else None
        bounds = self.exported.ranges.get(expr) if self.exported is not None and expr is not None else None
        return int(size) if bounds is None else int(bounds.lower)

    def smallest_microbatch(self, inputs, target, planned: int) -> int:
        """The fewest samples a microbatch may hold with the graph at `planned` samples: any with fx;
        with an export whose batch stayed symbolic 2, or 1 where the graph at one sample (of
        `inputs`) is the symbolic one and gives eager's loss; `planned` where export fixed the batch."""
        if self.tracer == "fx":
            return 1
        value = next(n for n in self.template.graph.nodes if n.op == "placeholder").meta.get("val")
        if not isinstance(value, torch.Tensor) or not isinstance(value.shape[0], torch.SymInt):
            return planned
        if not self._has_weights():
            return 2  # no weights to run eager with (a model planned on the meta device)

        def one(value):
            return value[:1] if isinstance(value, torch.Tensor) and value.dim() else value

        inputs = {k: one(v) for k, v in inputs.items()} if isinstance(inputs, dict) else tuple(map(one, inputs))
        target, leaves = one(target), self._leaves(inputs, one(target))
        try:
            verify = self._bound(self.template, leaves)[1]
        except NotCovered:
            return 2
        if not verify:
            return 1
        # Only run, never planned: the template as the stages run it, without values or FLOPs at this size.
        runnable = copied(self.template)
        functionalize(runnable)
        with _buffers_kept(self.objective._stagewise_model):
            return 1 if self._agrees_with_eager(runnable, inputs, target, leaves) else 2

    def _graph_at(self, inputs, target) -> fx.GraphModule:
        if self.tracer == "fx":
            return self.propagated(inputs, target)
        leaves = self._leaves(inputs, target)
        try:
            gm, verify = self._specialised(self.template, leaves, inputs, target)
            if not verify or self._agrees_with_eager(gm, inputs, target, leaves):
                return gm
        except NotCovered:
            pass
        # The capture does not describe this size: export again, at this size.
        template, _ = trace_export(self.objective, inputs, target, len(self.input_names), False)
        self.exports += 1
        normalise(template, self.input_names + ([self.target_name] if self.target_name else []))
        return self._specialised(template, leaves, inputs, target)[0]

    def propagated(self, inputs, target) -> fx.GraphModule:
        """A copy of the template with values and FLOPs from fake-tensor propagation at this size
        (a graph that computes its own sizes: fx's, or one saved for re-planning)."""
        gm = copied(self.template)
        annotate(gm, inputs, target)
        functionalize(gm)
        check_loss(gm)
        return gm

    def _leaves(self, inputs, target) -> list:
        """The flat graph inputs, in placeholder order (as torch.export flattens its arguments)."""
        args = (inputs, target) if self.objective._stagewise_loss_fn is not None else (inputs,)
        return tree_flatten(args)[0]

    def _specialised(self, template: fx.GraphModule, leaves: list, inputs, target) -> tuple[fx.GraphModule, bool]:
        """A copy of an exported template with its symbols bound by `leaves`' shapes: values, FLOPs
        and literal sizes at that size; and whether the size needs the check against eager."""
        bindings, verify = self._bound(template, leaves)
        graph = copy_graph(template)
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        evaluate = Evaluator(bindings, mode)
        try:
            for node in graph.nodes:
                if node.op == "output":
                    node.meta["val"] = map_arg(node.args[0], lambda n: n.meta["val"])
                else:
                    node.meta["val"] = evaluate.value(node.meta.get("val"))
            for node in graph.nodes:
                node.meta["flops"] = op_flops(template, node, mode, self.flop_memo)
        except Exception:  # noqa: BLE001 - what is not evaluated here (Unsupported) is propagated
            annotate(module_of(template, graph), inputs, target)
        gm = module_of(template, graph)
        functionalize(gm)
        check_loss(gm)
        return gm, verify

    def _bound(self, template: fx.GraphModule, leaves: list) -> tuple[dict, bool]:
        """The template's symbols bound by `leaves`' shapes, checked against the export's ranges (and its
        guards, for this capture's own template); NotCovered where it does not describe them."""
        ranges = self.exported.ranges if self.exported is not None else {}
        guards = self.exported.guards if self.exported is not None and template is self.template else None
        return bind(template, leaves, ranges, guards)

    def _has_weights(self) -> bool:
        return not any(p.is_meta for p in self.objective._stagewise_model.parameters())

    def _agrees_with_eager(self, gm: fx.GraphModule, inputs, target, leaves: list) -> bool:
        """One forward of the graph and of the model on the same inputs give the same loss (False for a
        model without weights, a meta-device one: it is exported again at this size)."""
        if not self._has_weights():
            return False
        args = (inputs, target) if self.objective._stagewise_loss_fn is not None else (inputs,)
        try:
            with torch.no_grad(), torch.random.fork_rng(devices=[]), _buffers_kept(gm):
                torch.manual_seed(0)
                want = self.objective(*args)
                torch.manual_seed(0)
                got = gm(*leaves)
        except Exception:  # noqa: BLE001 - cannot compare: export at this size instead
            return False
        return (isinstance(got, torch.Tensor) and isinstance(want, torch.Tensor) and got.shape == want.shape
                and bool(torch.allclose(got, want, rtol=1e-4, atol=1e-6)))


@contextlib.contextmanager
def _buffers_kept(module: torch.nn.Module):
    """Tracing, fake propagation or a check run may update buffers in place (BatchNorm): undo it."""
    buffers = {k: b.detach().clone() for k, b in module.named_buffers()}
    try:
        yield
    finally:
        with torch.no_grad():
            for k, b in module.named_buffers():
                b.copy_(buffers[k])


def _first_line(err: Exception) -> str:
    text = str(err).strip().splitlines()
    return text[0][:300] if text else ""
