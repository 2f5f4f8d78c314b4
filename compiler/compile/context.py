"""What the compile phases share: the request, then each phase's result.

`compile()` hands one `CompileContext` to the phases in order (compiler/compile/phases.py); each phase
reads what earlier ones left in it and adds its own result, so a test can run any prefix of
them and look at what each produced.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TypeVar

import torch.fx as fx

from stagewise.compiler.assembly.options import CompileRequest
from stagewise.compiler.assembly.runtime_setup import Runtime
from stagewise.compiler.compile.analysis import Analysed, Analysis
from stagewise.compiler.compile.costing import Costs
from stagewise.compiler.compile.planning import Choice
from stagewise.ir.errors import PlanError
from stagewise.ir.plan import Plan

T = TypeVar("T")


@dataclass
class CompileContext:
    """The request, then what each phase made of it (None until that phase ran)."""

    request: CompileRequest
    analysis: Analysis | None = None  # capture: the model captured once, graphs per size on demand
    first: Analysed | None = None  # analyse: the graph at the first microbatch count, layers, cut-points
    costs: Costs | None = None  # cost
    choice: Choice | None = None  # plan: the chosen plan, its prediction and costs
    plan: Plan | None = None  # plan: the IR
    modules: list[fx.GraphModule] | None = None  # codegen: one per stage
    runtime: Runtime | None = None  # runtime: this process's pools, transport, workers and executor
    seconds: dict[str, float] = field(default_factory=dict)  # per phase, as compile ran them


def after(value: T | None, producer: str) -> T:
    """A phase's input, which the `producer` phase must have made."""
    if value is None:
        raise PlanError(f"this compile phase needs the result of the {producer} phase: run that phase first")
    return value
