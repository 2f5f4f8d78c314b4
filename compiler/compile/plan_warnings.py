"""What compile says about a plan before it runs: that the plan asked for will not fit, or that `sw.plan`
timed a GPU at an assumed rate. Warnings, since the plan is kept as asked."""

from __future__ import annotations

import warnings

from stagewise.compiler.assembly.options import CompileRequest
from stagewise.ir.errors import AssumedFiguresWarning, DoesNotFitWarning
from stagewise.passes.analytic import DEFAULT_PEAK_FLOPS
from stagewise.passes.capacity import shortfalls
from stagewise.passes.planner import Prediction


def warn_does_not_fit(prediction: Prediction, request: CompileRequest) -> None:
    """The plan asked for is kept as asked, but its first step would fail for memory: say so now,
    with what would fit instead (the planner's search refuses such a candidate: passes/planner.py)."""
    over = shortfalls(prediction.peak_bytes, prediction.hosts_over, request.specs)
    warnings.warn(DoesNotFitWarning(
        f"the plan asked for does not fit: {'; '.join(over)}. Its first step will fail with a CapacityError; "
        "let the planner choose (schedule='auto'), swap or recompute activations (swap='on', activations='auto'), "
        "or add devices"), stacklevel=2)


def warn_assumed_rates(request: CompileRequest) -> None:
    """`sw.plan` models every time from the devices' figures; a GPU described without `peak_flops` would
    be timed at an assumed rate (passes/analytic.py) whatever it is: say so, naming the option."""
    unrated = sorted({spec.name for spec in request.specs if spec.kind == "cuda" and spec.peak_flops is None})
    if unrated:
        warnings.warn(AssumedFiguresWarning(
            f"sw.plan: {', '.join(unrated)} has no peak_flops, so the plan's times assume "
            f"{DEFAULT_PEAK_FLOPS['cuda']:.0e} FLOP/s, whatever GPU it is; describe it, e.g. sw.Device('cuda', "
            "memory='80GiB', peak_flops='989TFLOPS', memory_bandwidth='3.35TB/s'), or name it from the catalogue "
            "(devices='8xH100')"), stacklevel=2)
