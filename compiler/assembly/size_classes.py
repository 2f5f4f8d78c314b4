"""The sizes of what a step sends, for a whole class of input sizes, from one propagation.

Running the stage modules on fake tensors for every new microbatch shape cost a step's worth of
Python (hundreds of ops dispatched per stage). Run once on fake tensors whose sizes are symbols
(torch's ShapeEnv, as torch.compile's dynamic shapes), every sent value's shape comes out as an
expression of the input sizes, and every decision the code took on those sizes is recorded as a
guard. A later microbatch whose sizes satisfy the guards takes the same path through the code:
its shapes are the expressions evaluated at its sizes, in microseconds. Sizes that break a guard
(a length the code branches on, a size of 1, two inputs whose equal lengths the code relies on)
are not in the class: the caller propagates them concretely, which also refuses what the code
cannot take.
"""

from __future__ import annotations

from collections.abc import Callable
from types import CodeType

import sympy
import torch
from torch._dispatch.python import enable_python_dispatcher
from torch._dynamo.source import LocalSource
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.fx.experimental.symbolic_shapes import SYMPY_INTERP, DimDynamic, ShapeEnv, StatelessSymbolicContext

Signature = tuple[tuple[str, tuple[int, ...], torch.dtype], ...]  # (graph input, sizes, dtype) of one microbatch
ValueSpec = tuple[tuple[int, ...], torch.dtype]  # a sent value's sizes and dtype
ClassKey = tuple[tuple[str, int, torch.dtype], ...]  # (graph input, rank, dtype): what one symbolic run covers
Propagate = Callable[[FakeTensorMode, dict[str, torch.Tensor]], dict[str, torch.Tensor]]  # inputs -> every value


def class_key(signature: Signature) -> ClassKey:
    """The signatures one symbolic propagation may cover: same inputs, ranks and dtypes."""
    return tuple((name, len(size), dtype) for name, size, dtype in signature)


class SizeClass:
    """Every value's shape as an expression of the input sizes, valid wherever `guards` hold."""

    def __init__(self, shape_env: ShapeEnv, placeholders: list[FakeTensor], guards: CodeType | None,
                 values: dict[str, tuple[tuple[sympy.Expr, ...], torch.dtype]]):
        self.shape_env = shape_env
        self.placeholders = placeholders  # the symbolic inputs, in signature order
        self.guards = guards  # compiled; None: the code took no decision on the sizes
        self.values = values

    @classmethod
    def traced(cls, hints: Signature, propagate: Propagate) -> SizeClass | None:
        """The class of `hints`' sizes (the example's): `propagate` run once on symbolic sizes.
        None where the values' shapes are not expressions of the input sizes (data-dependent)."""
        shape_env = ShapeEnv()
        with torch._dynamo.config.patch(fake_tensor_cache_enabled=False):  # its hits rebuild every symbolic size: 3x slower
            mode = FakeTensorMode(shape_env=shape_env)
        placeholders = [_symbolic(mode, name, size, dtype) for name, size, dtype in hints]
        with enable_python_dispatcher():  # composite ops decompose on symbols instead of reading concrete sizes
            env = propagate(mode, {name: p for (name, _, _), p in zip(hints, placeholders, strict=True)})
        known = {symbol for p in placeholders for size in p.shape for symbol in sympy.sympify(_expr(size)).free_symbols}
        values = {}
        for name, value in env.items():
            if not isinstance(value, torch.Tensor):
                continue
            sizes = tuple(shape_env.replace(sympy.sympify(_expr(d))) for d in value.shape)
            if any(not size.free_symbols <= known for size in sizes):
                return None
            values[name] = (sizes, value.dtype)
        code = shape_env.produce_guards_expression(placeholders, ignore_static=False)
        guards = compile(code, "<size class guards>", "eval") if code else None
        return cls(shape_env, placeholders, guards, values)

    def at(self, signature: Signature) -> dict[str, ValueSpec] | None:
        """Every value's sizes and dtype for a microbatch of these sizes; None outside the class."""
        stand_ins = [torch.empty(size, dtype=dtype, device="meta") for _, size, dtype in signature]
        arguments = {"L": {f"t{i}": t for i, t in enumerate(stand_ins)}}
        if self.guards is not None and not eval(self.guards, SYMPY_INTERP, arguments):  # noqa: S307 - torch's own guard code
            return None
        bound = self.shape_env.bind_symbols(self.placeholders, stand_ins)
        values = {}
        for name, (sizes, dtype) in self.values.items():
            evaluated = [sympy.sympify(sympy.sympify(size).xreplace(bound)) for size in sizes]
            if not all(isinstance(size, sympy.Integer) for size in evaluated):  # a function left unevaluated
                return None
            values[name] = (tuple(int(size) for size in evaluated), dtype)
        return values


def _symbolic(mode: FakeTensorMode, name: str, size: tuple[int, ...], dtype: torch.dtype) -> FakeTensor:
    """A fake input whose every size is a symbol; sizes equal in the hints share one (duck sizing),
    which the guards then check."""
    context: StatelessSymbolicContext = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DUCK] * len(size))
    return mode.from_tensor(torch.empty(size, dtype=dtype, device="meta"), symbolic_context=context,
                            source=LocalSource(name))


def _expr(size: int | torch.SymInt) -> sympy.Expr | int:
    return size.node.expr if isinstance(size, torch.SymInt) else size
