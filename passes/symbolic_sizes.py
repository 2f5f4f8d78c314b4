"""Symbolic sizes of an exported graph, evaluated at one set of input sizes.

torch.export with symbolic sizes (batch, sequence length, ...) gives every node a value whose sizes
are sympy expressions in those symbols. At a microbatch's sizes the symbols are bound from the
inputs' shapes (checked against the export's ranges and guards) and every value is evaluated there
(the graph's size nodes stay: the stage code reads its sizes, passes/local_sizes.py).

torch's own input check (torch._export.utils._check_input_constraints_for_graph) binds much
the same way, but it is private, returns no bindings, and lets sizes 0 and 1 through a range
that starts at 2 without a word, where the capture must know (a batch of 1 is used only after
a check against eager, 0 not at all): so the binding is done here.
"""

from __future__ import annotations

from collections.abc import Callable

import sympy
import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode

SYMBOLIC = (torch.SymInt, torch.SymFloat, torch.SymBool)


class NotCovered(Exception):
    """The exported graph does not describe this size."""


class Unsupported(Exception):
    """A value or op that the evaluation of symbolic values here does not handle."""


def bind(template: fx.GraphModule, leaves: list, ranges: dict,
         guards: Callable | None) -> tuple[dict[sympy.Symbol, int], bool]:
    """Symbol -> size from the inputs' shapes; checked against export's ranges and guards.
    Also whether the size needs the check against eager (export assumed it away)."""
    placeholders = [n for n in template.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(leaves):
        raise NotCovered("inputs do not match the graph's placeholders")
    bindings = _bindings(placeholders, leaves)
    verify = _within_ranges(bindings, ranges)
    if guards is not None:
        try:
            guards(*leaves)
        except Exception as err:  # noqa: BLE001 - a failed guard means "not this size"
            raise NotCovered(f"export's guards reject the size: {err}") from err
    return bindings, verify


def _bindings(placeholders: list[fx.Node], leaves: list) -> dict[sympy.Symbol, int]:
    """Each symbol's size from the first input dimension it stands for; every other dimension
    (a literal, an expression, a symbol met before) must agree with them."""
    bindings: dict[sympy.Symbol, int] = {}
    derived = []
    for node, leaf in zip(placeholders, leaves, strict=True):
        value = node.meta.get("val")
        if not isinstance(value, torch.Tensor) or not isinstance(leaf, torch.Tensor):
            continue
        if value.dim() != leaf.dim():
            raise NotCovered(f"{node.name} has {leaf.dim()} dimensions, traced with {value.dim()}")
        for want, got in zip(value.shape, leaf.shape, strict=True):
            expr = want.node.expr if isinstance(want, torch.SymInt) else sympy.Integer(want)
            if isinstance(expr, sympy.Symbol) and expr not in bindings:
                bindings[expr] = int(got)
            else:
                derived.append((expr, int(got)))
    for expr, got in derived:
        if expr.xreplace(bindings) != got:
            raise NotCovered(f"an input size {got} differs from the traced {expr}")
    return bindings


def _within_ranges(bindings: dict[sympy.Symbol, int], ranges: dict) -> bool:
    """Every bound size lies in its symbol's exported range; True where a size is 1 below a range
    that starts at 2 (0/1 specialisation: export assumed a size of at least 2)."""
    verify = False
    for symbol, size in bindings.items():
        bounds = ranges.get(symbol)
        if bounds is None or bool(sympy.Integer(size) > bounds.upper):
            raise NotCovered(f"size {size} is outside the exported range of {symbol}")
        if bool(sympy.Integer(size) < bounds.lower):
            if size != 1 or bounds.lower != 2:
                raise NotCovered(f"size {size} is below the exported range of {symbol}")
            verify = True
    return verify


class Evaluator:
    """Symbolic values of an exported graph evaluated at bound symbols (memoised per expression)."""

    def __init__(self, bindings: dict, mode: FakeTensorMode):
        self.bindings, self.mode = bindings, mode
        self.memo: dict = {}

    def number(self, value):
        if not isinstance(value, SYMBOLIC):
            return value
        kind = int if isinstance(value, torch.SymInt) else float if isinstance(value, torch.SymFloat) else bool
        key = (kind, value.node.expr)
        if key not in self.memo:
            expr = value.node.expr
            result = expr.xreplace(self.bindings) if isinstance(expr, sympy.Basic) else expr
            if isinstance(result, sympy.Basic) and result.free_symbols:
                raise Unsupported(f"{expr} depends on more than the input sizes")
            self.memo[key] = kind(result)
        return self.memo[key]

    def value(self, value):
        if isinstance(value, torch.Tensor):
            if value.layout != torch.strided:
                raise Unsupported(f"a {value.layout} tensor")
            size = [self.number(d) for d in value.shape]
            stride = [self.number(d) for d in value.stride()]
            with self.mode:  # as FakeTensorProp leaves them: no autograd history, requires_grad False
                return torch.empty_strided(size, stride, dtype=value.dtype, device=value.device)
        if isinstance(value, list | tuple):
            return type(value)(self.value(v) for v in value)
        return self.number(value)
