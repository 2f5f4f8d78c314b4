"""training.pt's entries checked, against their types and the saved plan, before any is used.

Why: `weights_only` keeps training.pt to plain values and tensors, but an attacker who rewrites it
(and the marker) chooses those values. Unchecked, a step count that is a string, a loss reduction
without its kind or optimizer groups that are not a list reached the runtime as a raw TypeError in
the middle of `sw.load` or of the next step, and a stage listed as swapped that the programs never
swap made that step fail after part of it ran. Each entry `sw.load` reads is checked here, once,
where the checkpoint is read; a refusal names the file, the entry and its value. Entries this
version does not read are left alone (a checkpoint from a newer version may add some).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from pathlib import Path

from stagewise.compiler.assembly.loss_reduction import check_loss_reduction, reduction_from_data
from stagewise.compiler.assembly.plain_values import is_int as _is_int
from stagewise.compiler.assembly.plain_values import is_number as _is_number
from stagewise.ir.declared import ALTERED
from stagewise.ir.errors import CheckpointError, StagewiseError
from stagewise.ir.instructions import Free, State, SwapIn, SwapOut
from stagewise.ir.plan import Plan
from stagewise.ir.precision import LossScaling
from stagewise.runtime.stage_calls import Acceleration

_LARGEST_STEP = 2 ** 62  # a step count no run reaches, and still an int64 for the random draws keyed by it
_REDUCTIONS = {"TokenMean": {"ignore_index", "labels", "shift"}, "SampleMean": {"labels"}}
_SCALER = {"scaling", "scale", "clean_steps"}
_ACCELERATION = {field.name for field in dataclasses.fields(Acceleration)}
_PADDING = {"multiple", "sizes", "longest", "fills", "labels"}


def check_training(training: dict, plan: Plan, path: Path) -> None:
    """Raises CheckpointError, naming `path` and the entry, for an entry of the wrong type or out of
    range, or one that disagrees with `plan` (the checkpoint's plan.json)."""
    for key, problem_of in _CHECKS.items():
        if key not in training:
            continue
        problem = problem_of(training[key], plan)
        if problem is not None:
            raise CheckpointError(f"{path} gives {key}={repr(training[key])[:80]}, {problem}; {ALTERED}")


def _step(value: object, plan: Plan) -> str | None:
    if _is_int(value) and 0 <= value <= _LARGEST_STEP:  # type: ignore[operator]  # an int: _is_int
        return None
    return "not a step count (an int from 0)"


def _clip(value: object, plan: Plan) -> str | None:
    if value is None or _is_number(value) and math.isfinite(value) and value > 0:  # type: ignore[arg-type,operator]
        return None
    return "not a gradient-norm bound (a positive finite number, or None)"


def _table_or_none(value: object, plan: Plan) -> str | None:
    if value is None or isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return None
    return "not a table of named values (or None)"


def _mode(value: object, plan: Plan) -> str | None:
    return None if value is None or isinstance(value, bool) else "not True or False (train or eval mode)"


def _loss_reduction(value: object, plan: Plan) -> str | None:
    if value is None:
        return None
    if not isinstance(value, dict) or value.get("kind") not in _REDUCTIONS:
        return f"not a loss reduction (a table whose kind is one of {sorted(_REDUCTIONS)})"
    unknown = set(value) - {"kind"} - _REDUCTIONS[value["kind"]]
    if unknown:
        return f"with fields {value['kind']} does not have ({sorted(unknown)})"
    try:
        reduction = reduction_from_data(value)
        check_loss_reduction(reduction, plan.target_name is not None, list(plan.input_names))
    except StagewiseError as error:
        return f"a loss reduction this plan cannot use ({error})"
    return None


def _loss_scaler(value: object, plan: Plan) -> str | None:
    if value is None:
        return None
    if not isinstance(value, dict) or set(value) != _SCALER or not isinstance(value["scaling"], dict):
        return f"not a loss scaler's state (a table of {sorted(_SCALER)})"
    try:
        LossScaling(**value["scaling"])
    except (TypeError, StagewiseError) as error:
        return f"a loss scaling its fields cannot make ({error})"
    scale, clean_steps = value["scale"], value["clean_steps"]
    if not (_is_number(scale) and math.isfinite(scale) and scale > 0):
        return "a loss scale that is not a positive finite number"
    if not (_is_int(clean_steps) and 0 <= clean_steps <= _LARGEST_STEP):
        return "a count of clean steps that is not an int from 0"
    return None


def _optimizer_groups(value: object, plan: Plan) -> str | None:
    if not isinstance(value, list):
        return "not a list of optimizer parameter groups"
    for group in value:
        if not isinstance(group, dict) or not all(isinstance(k, str) for k in group):
            return "a parameter group that is not a table of named hyper-parameters"
        names = group.get("param_names")
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            return "a parameter group whose param_names are not a list of names"
    return None


def _optimizer_values(value: object, plan: Plan) -> str | None:
    if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, dict) for k, v in value.items()):
        return "not a table of per-parameter optimizer values"
    return None


def _swapped(value: object, plan: Plan) -> str | None:
    """The stages whose state lives in host memory: distinct stages of the plan, those the plan's
    costs record, and each one whose weights the programs swap."""
    stages = {stage.index for stage in plan.stages}
    if not isinstance(value, list) or not all(_is_int(s) and s in stages for s in value) or len(set(value)) != len(value):
        return f"not a list of distinct stages (of {sorted(stages)})"
    if plan.costs is not None and sorted(value) != sorted(plan.costs.swapped):
        return f"where plan.json's costs swap stages {sorted(plan.costs.swapped)}"
    moved = {i.stage for program in plan.programs for i in program.instructions
             if isinstance(i, SwapIn | SwapOut | Free) and i.state is State.WEIGHTS}
    never = sorted(set(value) - moved)
    return None if not never else f"where the programs never swap the weights of stages {never}"


def _padding(value: object, plan: Plan) -> str | None:
    """compile's shape_buckets: a step pads up to `longest` at most, so it must be the example's
    sequence length in the plan's input specs (a larger one would allocate what was never planned)."""
    if value is None:
        return None
    if not isinstance(value, dict) or set(value) != _PADDING:
        return f"not a padding (a table of {sorted(_PADDING)})"
    multiple, sizes, longest, fills, labels = (value[k] for k in ("multiple", "sizes", "longest", "fills", "labels"))
    names = [*plan.input_names, *([plan.target_name] if plan.target_name is not None else [])]
    specs = dict(zip(names, plan.input_specs, strict=False))
    if (multiple is None) == (not sizes) or multiple is not None and not (_is_int(multiple) and multiple >= 1):
        return "not one multiple (a positive int) or one list of lengths"
    if not isinstance(sizes, list) or not all(_is_int(s) and 1 <= s <= longest for s in sizes):
        return "lengths that are not positive ints up to the longest"
    if not isinstance(fills, dict) or not fills or not all(_is_number(f) for f in fills.values()):
        return "fills that are not a table of padded inputs and their numbers"
    if any(name not in specs or not specs[name].batched or specs[name].shape[:1] != (longest,) for name in fills):
        return f"a longest length or padded inputs other than the plan's inputs of that length ({sorted(specs)})"
    if not isinstance(labels, list) or not set(labels) <= set(fills):
        return "labels that are not padded inputs"
    return None


def _acceleration(value: object, plan: Plan) -> str | None:
    if value is None or isinstance(value, dict) and set(value) == _ACCELERATION and all(
            isinstance(v, bool) for v in value.values()):
        return None
    return f"not compile's stage acceleration (a table of {sorted(_ACCELERATION)}, each True or False)"


_CHECKS: dict[str, Callable[[object, Plan], str | None]] = {
    "step": _step, "clip_grad_norm": _clip, "extra": _table_or_none, "scheduler": _table_or_none,
    "mode_training": _mode, "loss_reduction": _loss_reduction, "loss_scaler": _loss_scaler,
    "optimizer": _table_or_none, "optimizer_groups": _optimizer_groups, "optimizer_values": _optimizer_values,
    "swapped": _swapped, "padding": _padding, "acceleration": _acceleration,
}

