"""The values of compile's `schedule=` and `cost=` options, as str enums the plan records.

They are `StrEnum`s so that plan.json, programs.txt and checkpoints keep the same text, and the
public API takes either a member (`sw.Schedule.GPIPE`) or its string ("gpipe").
"""

from __future__ import annotations

import enum
from typing import TypeVar

from stagewise.ir.errors import OptionError

Choice = TypeVar("Choice", bound=enum.StrEnum)


class Schedule(enum.StrEnum):
    """A pipeline schedule (passes/schedule.py builds each); AUTO lets the planner choose."""

    AUTO = "auto"
    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"
    INTERLEAVED = "interleaved"
    VARUNA = "varuna"
    HARMONY_PP = "harmony-pp"
    HARMONY_DP = "harmony-dp"


class CostModel(enum.StrEnum):
    """Where the planner's per-layer costs come from: measured on this machine or from FLOPs and peak rates."""

    PROFILE = "profile"
    ANALYTIC = "analytic"


def choice_names(choices: type[enum.StrEnum]) -> str:
    """The valid values, quoted and comma-separated, for an error message."""
    return ", ".join(repr(str(member)) for member in choices)


def parse_choice(choices: type[Choice], value: object, label: str) -> Choice:
    """`value` (a member or its string) as a member of `choices`; OptionError naming the valid values
    otherwise. `label` starts the message: "schedule " or "cost=" (how the option was spelled)."""
    if isinstance(value, str):  # a bool or list is no option value, even where it would hash equal
        try:
            return choices(value)
        except ValueError:
            pass
    raise OptionError(f"unknown {label}{value!r}; choose one of {choice_names(choices)}")
