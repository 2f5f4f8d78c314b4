"""What `Pipeline.load_state_dict` accepts, checked before anything is copied.

The keys are the original model's `state_dict()` keys (`Plan.state_names`): every alias of a
tied weight or of a module registered under two names, and the layers no stage holds. As in
torch, a key the model lacks is unexpected and a key the model has that the state_dict lacks is
missing, both errors unless `strict=False`; a tensor of another shape is an error always. One
difference: names of one tensor (`Plan.aliases`) stand for each other, so a state_dict that
names a tied weight once is complete (torch would report the other name missing); two names of
one tensor holding different values are an error, as no single tensor can hold both.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

import torch

from stagewise.ir.errors import StateDictError
from stagewise.ir.plan import Plan

_SHOWN = 5  # keys named in one message


class IncompatibleKeys(NamedTuple):
    """What `load_state_dict` did not match, as torch's `_IncompatibleKeys`."""

    missing_keys: list[str]
    unexpected_keys: list[str]


def aliases_of(plan: Plan, name: str) -> tuple[str, ...]:
    """`name` and then the other names of its tensor."""
    for group in plan.aliases:
        if name in group:
            return (name,) + tuple(a for a in group if a != name)
    return (name,)


def model_name(plan: Plan, name: str) -> str:
    """The name `model.named_parameters()` gives the tensor a stage calls `name`: the first of
    its names in the model's state_dict order."""
    aliases = aliases_of(plan, name)
    position = {n: i for i, n in enumerate(plan.state_names)}
    return min(aliases, key=lambda n: position.get(n, len(position)))


def check_state_dict(plan: Plan, state_dict: Mapping[str, object], strict: bool,
                     shapes: Mapping[str, tuple[int, ...]]) -> IncompatibleKeys:
    """The keys `state_dict` lacks and those the model lacks; raises StateDictError, naming the
    key, for a shape other than `shapes` (the model's, per name), a non-tensor, two names of one
    tensor with different values, and (`strict`) any unexpected or missing key."""
    if not isinstance(state_dict, Mapping):
        raise StateDictError(f"load_state_dict takes a mapping of names to tensors (a model's state_dict()), "
                             f"got {type(state_dict).__name__}")
    expected = set(plan.state_names)
    unexpected = [key for key in state_dict if key not in expected]
    missing = [n for n in plan.state_names if not any(a in state_dict for a in aliases_of(plan, n))]
    for key, value in state_dict.items():
        if key in expected:
            _check_value(plan, state_dict, key, value, shapes.get(key))
    if strict and (unexpected or missing):
        raise StateDictError(_strict_message(unexpected, missing))
    return IncompatibleKeys(missing, unexpected)


def _check_value(plan: Plan, state_dict: Mapping[str, object], key: str, value: object,
                 shape: tuple[int, ...] | None) -> None:
    if not isinstance(value, torch.Tensor):
        raise StateDictError(f"state_dict[{key!r}] is a {type(value).__name__}, not a tensor; nothing was loaded")
    if shape is not None and tuple(value.shape) != tuple(shape):
        raise StateDictError(
            f"state_dict[{key!r}] has shape {tuple(value.shape)} but the model's {key} has shape {tuple(shape)}; "
            "nothing was loaded (a state_dict of another model or configuration?)"
        )
    for alias in aliases_of(plan, key)[1:]:
        other = state_dict.get(alias)
        if isinstance(other, torch.Tensor) and other is not value and not torch.equal(other, value.to(other)):
            raise StateDictError(
                f"state_dict[{key!r}] and state_dict[{alias!r}] differ, but they name one tensor of the model "
                "(tied); nothing was loaded: give them the same value, or only one of them"
            )


def _strict_message(unexpected: list[str], missing: list[str]) -> str:
    parts = []
    if unexpected:
        parts.append(f"{len(unexpected)} key(s) the model does not have: {_listed(unexpected)}")
    if missing:
        parts.append(f"no value for {len(missing)} key(s) of the model: {_listed(missing)}")
    return (f"load_state_dict: {'; '.join(parts)}; nothing was loaded. Pass strict=False to load the keys "
            "that match and leave the rest (as torch's load_state_dict)")


def _listed(keys: list[str]) -> str:
    shown = ", ".join(repr(k) for k in keys[:_SHOWN])
    return shown + (f" and {len(keys) - _SHOWN} more" if len(keys) > _SHOWN else "")
