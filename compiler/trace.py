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
- torch.export (`dynamic=True`) is asked for a graph whose batch dimension is one symbol
  (`Dim.AUTO` on dim 0 of every input). At a size the graph is copied with the symbol bound:
  every node's value is the export's own symbolic value evaluated there, FLOPs come from
  torch.utils.flop_counter's formulas on those shapes, and the symbolic size nodes
  (`sym_size` feeding `view`, `reshape`, `expand`, `arange`) are folded into the literal sizes
  the generated stage code then holds, as in a graph exported at that size.

A size the symbolic graph does not cover is exported again, statically, at that size: the
model cannot keep its batch symbolic (export specialised it: `if x.shape[0] == 4`, a
data-dependent shape), the example batch is 1, or the size fails the export's own range
constraints and guards. Size 1 is special: export assumes a symbolic size is at least 2
(0/1 specialisation) yet accepts 1 at run time; a model whose Python code branches on a
batch of one would then differ from eager, so at size 1 the graph is used only after one
forward of it gives eager's loss on the same inputs (else it is exported at size 1).
"""

from __future__ import annotations

import contextlib
import inspect
import re
from collections.abc import Callable
from dataclasses import dataclass

import sympy
import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.node import map_arg
from torch.fx.passes.fake_tensor_prop import FakeTensorProp
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.flop_counter import FlopCounterMode, flop_registry

from stagewise.ir.errors import ExampleInputsError, LossError, TraceError
from stagewise.ir.subgraph import attribute

_SYMBOLIC = (torch.SymInt, torch.SymFloat, torch.SymBool)
# Run-time assertions on symbolic sizes; once the sizes are literals they are checked here instead.
_ASSERTS = {
    torch.ops.aten._assert_scalar.default,
    torch.ops.aten.sym_constrain_range.default,
    torch.ops.aten.sym_constrain_range_for_size.default,
}


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

    def __init__(self, model: torch.nn.Module, loss_fn, keyword: bool):
        super().__init__()
        object.__setattr__(self, "_stagewise_model", model)
        object.__setattr__(self, "_stagewise_loss_fn", loss_fn)
        object.__setattr__(self, "_stagewise_keyword", keyword)
        object.__setattr__(self, "_modules", model._modules)
        object.__setattr__(self, "_parameters", model._parameters)
        object.__setattr__(self, "_buffers", model._buffers)

    def forward(self, inputs, target=None):
        model = self._stagewise_model
        out = model.forward(**inputs) if self._stagewise_keyword else model.forward(*inputs)
        if self._stagewise_loss_fn is not None:
            return self._stagewise_loss_fn(out, target)
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
    target_name = "target" if loss_fn is not None else None
    if target_name in names:
        target_name = "loss_target"
    wanted = names + ([target_name] if target_name else [])
    failures = []
    with _buffers_kept(model):
        for tracer in (_trace_fx, _trace_export):
            try:
                gm, exported = tracer(objective, example_inputs, example_target, len(names), dynamic)
            except LossError:
                raise
            except Exception as err:  # noqa: BLE001 - every tracer failure is reported together
                failures.append(f"{tracer.__doc__.split(':')[0]}: {type(err).__name__}: {_first_line(err)}")
                continue
            _normalise(gm, wanted)
            return Capture(objective, "fx" if tracer is _trace_fx else "export", names, kind, target_name, gm, exported)
    raise TraceError(
        "could not capture the model as a graph.\n  "
        + "\n  ".join(failures)
        + "\nWhat to do: replace Python control flow that depends on tensor values (if x.sum() > 0:) "
        "with tensor operations (torch.where) or torch.cond, so that one graph describes every step."
    )


@dataclass
class _Exported:
    """What torch.export says about the graph's inputs: their guards, the symbols' ranges, and
    whether the batch stayed symbolic (Dim.AUTO leaves it static where the model pins it)."""

    guards: Callable | None
    ranges: dict
    symbolic: bool


class _NotCovered(Exception):
    """The exported graph does not describe this size."""


class _Unsupported(Exception):
    """A value or op that the evaluation of symbolic values here does not handle."""


class Capture:
    """One capture of model + loss: a graph template, and the graph at any microbatch size.

    The template is normalised (placeholders named after the model's arguments, readable node
    names) but has no values of its own size: `at` copies it, so graphs at different sizes
    share the model's parameters and nothing else.
    """

    def __init__(self, objective: Objective, tracer: str, names: list[str], kind: str, target_name: str | None,
                 template: fx.GraphModule, exported: _Exported | None):
        self.objective, self.tracer, self.template, self.exported = objective, tracer, template, exported
        self.input_names, self.input_kind, self.target_name = names, kind, target_name
        self.exports = 1 if exported is not None else 0  # graphs exported so far
        self.flop_memo: dict[str, int] = {}

    def at(self, inputs, target) -> Traced:
        """The graph at the microbatch size of `inputs` (and `target`), with node.meta['val'] and
        ['flops'] at that size."""
        with _buffers_kept(self.objective._stagewise_model):
            gm = self._graph_at(inputs, target)
        return Traced(gm, self.tracer, self.input_names, self.input_kind, self.target_name)

    def _graph_at(self, inputs, target) -> fx.GraphModule:
        if self.tracer == "fx":
            gm = _copy(self.template)
            annotate(gm, inputs, target)
            _check_loss(gm)
            return gm
        leaves = self._leaves(inputs, target)
        try:
            gm, verify = self._specialised(self.template, leaves, inputs, target)
            if not verify or self._agrees_with_eager(gm, inputs, target, leaves):
                return gm
        except _NotCovered:
            pass
        # The capture does not describe this size: export again, at this size.
        template, _ = _trace_export(self.objective, inputs, target, len(self.input_names), False)
        self.exports += 1
        _normalise(template, self.input_names + ([self.target_name] if self.target_name else []))
        return self._specialised(template, leaves, inputs, target)[0]

    def _leaves(self, inputs, target) -> list:
        """The flat graph inputs, in placeholder order (as torch.export flattens its arguments)."""
        args = (inputs, target) if self.objective._stagewise_loss_fn is not None else (inputs,)
        return tree_flatten(args)[0]

    def _specialised(self, template: fx.GraphModule, leaves: list, inputs, target) -> tuple[fx.GraphModule, bool]:
        """A copy of an exported template with its symbols bound by `leaves`' shapes: values, FLOPs
        and literal sizes at that size; and whether the size needs the check against eager."""
        bindings, verify = self._bind(template, leaves)
        graph = _copy_graph(template)
        symbolic = [n for n in graph.nodes if isinstance(n.meta.get("val"), _SYMBOLIC)]
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        evaluate = _Evaluator(bindings, mode)
        try:
            for node in graph.nodes:
                if node.op == "output":
                    node.meta["val"] = map_arg(node.args[0], lambda n: n.meta["val"])
                else:
                    node.meta["val"] = evaluate.value(node.meta.get("val"))
            for node in graph.nodes:
                node.meta["flops"] = self._flops(template, node, mode)
        except Exception:  # noqa: BLE001 - what is not evaluated here (_Unsupported) is propagated
            annotate(_module(template, graph), inputs, target)
        _fold(graph, symbolic)
        gm = _module(template, graph)
        _check_loss(gm)
        return gm, verify

    def _flops(self, template: fx.GraphModule, node: fx.Node, mode: FakeTensorMode) -> int:
        """Forward FLOPs of one ATen node at its values' sizes, as FlopCounterMode counts them: an op
        with a formula by the formula, a composite op (linear, matmul, attention) by running its
        decomposition on fake tensors (once per op and argument shapes: repeated blocks hit the
        memo), any other op 0."""
        if node.op in ("placeholder", "get_attr", "output"):
            return 0
        op = node.target
        if node.op != "call_function" or isinstance(op, torch._ops.HigherOrderOperator):
            raise _Unsupported(f"{node.op} {op}")
        if not isinstance(op, torch._ops.OpOverload):
            return 0  # operator.getitem and the like
        args, kwargs = map_arg((node.args, node.kwargs), lambda n: n.meta["val"] if "val" in n.meta
                               else attribute(template, n.target))
        if op.overloadpacket in flop_registry:
            return int(flop_registry[op.overloadpacket](*args, **kwargs, out_val=node.meta["val"]))
        if not op.has_kernel_for_dispatch_key(torch._C.DispatchKey.CompositeImplicitAutograd):
            return 0
        key = repr((op, tree_map(_shape_key, (args, kwargs))))
        if key not in self.flop_memo:
            counter = FlopCounterMode(display=False)
            with mode, counter:
                op(*args, **kwargs)
            self.flop_memo[key] = int(counter.get_total_flops())
        return self.flop_memo[key]

    def _bind(self, template: fx.GraphModule, leaves: list) -> tuple[dict, bool]:
        """Symbol -> size from the inputs' shapes; checked against export's ranges and guards."""
        placeholders = [n for n in template.graph.nodes if n.op == "placeholder"]
        if len(placeholders) != len(leaves):
            raise _NotCovered("inputs do not match the graph's placeholders")
        bindings: dict[sympy.Symbol, int] = {}
        derived = []
        for node, leaf in zip(placeholders, leaves, strict=True):
            value = node.meta.get("val")
            if not isinstance(value, torch.Tensor) or not isinstance(leaf, torch.Tensor):
                continue
            if value.dim() != leaf.dim():
                raise _NotCovered(f"{node.name} has {leaf.dim()} dimensions, traced with {value.dim()}")
            for want, got in zip(value.shape, leaf.shape, strict=True):
                expr = want.node.expr if isinstance(want, torch.SymInt) else sympy.Integer(want)
                if isinstance(expr, sympy.Symbol) and expr not in bindings:
                    bindings[expr] = int(got)
                else:
                    derived.append((expr, int(got)))
        for expr, got in derived:
            if expr.xreplace(bindings) != got:
                raise _NotCovered(f"an input size {got} differs from the traced {expr}")
        verify = False
        ranges = self.exported.ranges if self.exported is not None else {}
        for symbol, size in bindings.items():
            bounds = ranges.get(symbol)
            if bounds is None or bool(sympy.Integer(size) > bounds.upper):
                raise _NotCovered(f"size {size} is outside the exported range of {symbol}")
            if bool(sympy.Integer(size) < bounds.lower):
                if size != 1 or bounds.lower != 2:
                    raise _NotCovered(f"size {size} is below the exported range of {symbol}")
                verify = True  # 0/1 specialisation: export assumed a size of at least 2
        guards = self.exported.guards if self.exported is not None and template is self.template else None
        if guards is not None:
            try:
                guards(*leaves)
            except Exception as err:  # noqa: BLE001 - a failed guard means "not this size"
                raise _NotCovered(f"export's guards reject the size: {err}") from err
        return bindings, verify

    def _agrees_with_eager(self, gm: fx.GraphModule, inputs, target, leaves: list) -> bool:
        """One forward of the graph and of the model on the same inputs give the same loss."""
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


class _Evaluator:
    """Symbolic values of an exported graph evaluated at bound symbols (memoised per expression)."""

    def __init__(self, bindings: dict, mode: FakeTensorMode):
        self.bindings, self.mode = bindings, mode
        self.memo: dict = {}

    def number(self, value):
        if not isinstance(value, _SYMBOLIC):
            return value
        kind = int if isinstance(value, torch.SymInt) else float if isinstance(value, torch.SymFloat) else bool
        key = (kind, value.node.expr)
        if key not in self.memo:
            expr = value.node.expr
            result = expr.xreplace(self.bindings) if isinstance(expr, sympy.Basic) else expr
            if isinstance(result, sympy.Basic) and result.free_symbols:
                raise _Unsupported(f"{expr} depends on more than the batch size")
            self.memo[key] = kind(result)
        return self.memo[key]

    def value(self, value):
        if isinstance(value, torch.Tensor):
            if value.layout != torch.strided:
                raise _Unsupported(f"a {value.layout} tensor")
            size = [self.number(d) for d in value.shape]
            stride = [self.number(d) for d in value.stride()]
            with self.mode:  # as FakeTensorProp leaves them: no autograd history, requires_grad False
                return torch.empty_strided(size, stride, dtype=value.dtype, device=value.device)
        if isinstance(value, list | tuple):
            return type(value)(self.value(v) for v in value)
        return self.number(value)


def _shape_key(value):
    """What an op's FLOPs can depend on: a tensor's shape, strides and dtype; any other value itself."""
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), tuple(value.stride()), value.dtype, value.device)
    return value


def _fold(graph: fx.Graph, symbolic: list[fx.Node]) -> None:
    """Symbolic size nodes become the literals they evaluate to; their assertions are checked now."""
    for node in symbolic:
        literal = node.meta["val"]
        for user in list(node.users):
            user.args = map_arg(user.args, lambda a, node=node, literal=literal: literal if a is node else a)
            user.kwargs = map_arg(user.kwargs, lambda a, node=node, literal=literal: literal if a is node else a)
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target in _ASSERTS and not node.all_input_nodes:
            if node.target is torch.ops.aten._assert_scalar.default and not node.args[0]:
                raise _NotCovered(f"a run-time assertion fails at this size: {node.args[1]}")
            graph.erase_node(node)
    for node in reversed(symbolic):
        graph.erase_node(node)
    graph.lint()


def _copy_graph(template: fx.GraphModule) -> fx.Graph:
    """The template's graph copied, node meta copied shallowly (values of one size are set on the copy)."""
    graph = fx.Graph()
    graph.output(graph.graph_copy(template.graph, {}))
    return graph


def _copy(template: fx.GraphModule) -> fx.GraphModule:
    return _module(template, _copy_graph(template))


def _module(template: fx.GraphModule, graph: fx.Graph) -> fx.GraphModule:
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


@contextlib.contextmanager
def _no_stack_traces():
    """torch.export records a Python stack trace for every node (a fifth of its time); nothing
    here reads them."""
    before = torch.fx.config.do_not_emit_stack_traces
    torch.fx.config.do_not_emit_stack_traces = True
    try:
        yield
    finally:
        torch.fx.config.do_not_emit_stack_traces = before


def _first_line(err: Exception) -> str:
    text = str(err).strip().splitlines()
    return text[0][:300] if text else ""


def _trace_fx(objective, example_inputs, example_target, n_inputs, dynamic=False) -> tuple[fx.GraphModule, None]:
    """torch.fx symbolic trace: keeps torch.nn leaves as call_module nodes."""
    structure = {k: fx.PH for k in example_inputs} if isinstance(example_inputs, dict) else (fx.PH,) * n_inputs
    tracer = fx.Tracer()
    graph = tracer.trace(objective, concrete_args={"inputs": structure})
    graph._codegen = fx.graph.CodeGen()
    return fx.GraphModule(tracer.root, graph, type(objective._stagewise_model).__name__), None


def _trace_export(objective, example_inputs, example_target, n_inputs, dynamic=False) -> tuple[fx.GraphModule, _Exported]:
    """torch.export (non-strict): ATen graph, module paths from nn_module_stack.

    `dynamic`: dim 0 of every input is `Dim.AUTO`, a symbol unless the model pins it; an export
    that fails that way is retried with static shapes."""
    args = (example_inputs, example_target) if objective._stagewise_loss_fn is not None else (example_inputs,)
    # The same tensor passed twice (input_ids as labels) would become one graph input.
    args = tree_map(lambda v: v.clone() if isinstance(v, torch.Tensor) else v, args)
    batched = [v for v in tree_flatten(args)[0] if isinstance(v, torch.Tensor) and v.dim() > 0]
    program = None
    if dynamic and batched and batched[0].shape[0] > 1:  # a batch of 1 would be pinned to 1 anyway
        shapes = tree_map(lambda v: {0: torch.export.Dim.AUTO} if isinstance(v, torch.Tensor) and v.dim() > 0 else None,
                          args)
        with contextlib.suppress(Exception), _no_stack_traces():
            program = torch.export.export(objective, args, dynamic_shapes=shapes, strict=False)
    if program is None:
        with _no_stack_traces():
            program = torch.export.export(objective, args, strict=False)
    gm = program.module()
    guards = getattr(gm, "_guards_fn", None)
    for node in list(gm.graph.nodes):
        if node.op == "call_module" and node.target == "_guards_fn":
            gm.graph.erase_node(node)
    symbolic = any(isinstance(n.meta.get("val"), torch.Tensor) and n.meta["val"].dim() > 0
                   and isinstance(n.meta["val"].shape[0], torch.SymInt) and n.meta["val"].shape[0].node.expr.free_symbols
                   for n in gm.graph.nodes if n.op == "placeholder")
    return gm, _Exported(guards, dict(program.range_constraints), bool(symbolic))


def _normalise(gm: fx.GraphModule, wanted: list[str]) -> None:
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
    """Fake-tensor shape propagation that also counts each node's forward FLOPs.

    A torch.nn leaf module (no children, no hooks) gives the same output shapes and FLOPs for the
    same configuration, state shapes and input shapes: repeated blocks (a chain of 1000
    Linear + ReLU, a ResNet's stages) are run once each and the rest take fresh fake tensors of
    the remembered shapes.
    """

    def __init__(self, module: fx.GraphModule, mode: FakeTensorMode):
        super().__init__(module, mode)
        self.memo: dict[str, tuple] = {}

    def run_node(self, n: fx.Node):
        if n.op not in ("call_function", "call_method", "call_module"):
            n.meta["flops"] = 0
            return super().run_node(n)
        key = self._module_key(n) if n.op == "call_module" else None
        if key is not None and key in self.memo:
            like, flops = self.memo[key]
            result = tree_map(lambda v: torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=v.device)
                              if isinstance(v, torch.Tensor) else v, like)
            n.meta["val"], n.meta["flops"] = result, flops
            return result
        counter = FlopCounterMode(display=False)
        with counter:
            result = super().run_node(n)
        n.meta["flops"] = int(counter.get_total_flops())
        if key is not None:
            self.memo[key] = (n.meta.get("val"), n.meta["flops"])
        return result

    def _module_key(self, n: fx.Node) -> str | None:
        module = self.module.get_submodule(n.target)
        if (next(module.children(), None) is not None or module._forward_hooks or module._forward_pre_hooks
                or not type(module).__module__.startswith("torch.nn")):
            return None
        config = sorted((k, v) for k, v in vars(module).items()
                        if isinstance(v, int | float | bool | str | torch.dtype | torch.device | tuple | None))
        state = [(k, tuple(t.shape), t.dtype, t.requires_grad) for k, t in
                 [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]]
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        return repr((type(module).__qualname__, config, state, tree_map(_shape_key, (args, kwargs))))


def _check_loss(gm: fx.GraphModule) -> None:
    (output,) = [n for n in gm.graph.nodes if n.op == "output"]
    value = output.args[0].meta.get("val") if isinstance(output.args[0], fx.Node) else output.args[0]
    if not isinstance(value, torch.Tensor) or value.numel() != 1 or not value.is_floating_point():
        shape = list(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        raise LossError(
            f"the model's output has shape {shape} (for one microbatch), not a scalar loss: pass loss_fn=(output, target) -> loss "
            "and example_target=, or make the model return its loss"
        )
