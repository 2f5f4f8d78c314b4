"""The values of compile's `schedule=`, `cost=` and `activations=` options, as str enums the plan records.

They are `StrEnum`s so that plan.json, programs.txt and checkpoints keep the same text, and the
public API takes either a member (`sw.Schedule.GPIPE`) or its string ("gpipe").
"""

from __future__ import annotations

import enum
from typing import TypeVar

from stagewise.ir.errors import OptionError

Choice = TypeVar("Choice", bound=enum.StrEnum)


class Schedule(enum.StrEnum):
    """compile's and plan's `schedule=`: a pipeline schedule (passes/schedule.py builds each); AUTO
    lets the planner choose. All are synchronous (one flush and update per step) but TWO_BW,
    PipeDream-2BW's asynchronous double-buffered updates. A member or its string is taken alike
    (an unknown string is an OptionError listing these).

    Example:
        >>> sw.Schedule("1f1b")
        <Schedule.ONE_F_ONE_B: '1f1b'>
        >>> sw.Schedule.GPIPE == "gpipe"
        True
    """

    AUTO = "auto"
    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"
    ZB_H1 = "zb-h1"
    INTERLEAVED = "interleaved"
    ZB_V = "zb-v"
    VARUNA = "varuna"
    HARMONY_PP = "harmony-pp"
    HARMONY_DP = "harmony-dp"
    TWO_BW = "2bw"

    @property
    def asynchronous(self) -> bool:
        """Whether the schedule's updates use stale gradients (PipeDream-2BW: one step stale), so
        training no longer equals synchronous SGD; only taken where compile's `asynchronous=True`."""
        return self is Schedule.TWO_BW

    @property
    def weight_versions(self) -> int:
        """Versions of each trained weight a stage holds: 2BW double-buffers them (Narayanan §3.2.1)."""
        return 2 if self is Schedule.TWO_BW else 1


class CostModel(enum.StrEnum):
    """compile's and plan's `cost=`: where the planner's per-layer costs come from, measured on this
    machine (PROFILE) or from FLOPs and the devices' peak rates (ANALYTIC, for devices not here).

    Example:
        >>> sw.CostModel("analytic")
        <CostModel.ANALYTIC: 'analytic'>
    """

    PROFILE = "profile"
    ANALYTIC = "analytic"


class ActivationPolicy(enum.StrEnum):
    """What a stage does with the activations a forward saves for its backward (its stash): KEEP them
    on the device, RECOMPUTE them from the forward's inputs just before the backward (Varuna §3.2:
    one more forward), or SWAP them to host memory and back (Harmony's sX: link time). compile's
    `activations=` takes these or AUTO (the planner chooses per stage by cost); each `Stage` of a
    plan records the one it runs.

    Example:
        >>> sw.ActivationPolicy("recompute")
        <ActivationPolicy.RECOMPUTE: 'recompute'>
    """

    AUTO = "auto"
    KEEP = "keep"
    RECOMPUTE = "recompute"
    SWAP = "swap"


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
