"""compile's `asynchronous=`: whether training may use stale gradients, which PipeDream-2BW does.

Every schedule but 2BW trains like eager synchronous SGD. 2BW (Narayanan §3.2.1) updates with
gradients one step stale, W(t+1) = W(t) - lr * grad f(W(t-1)): a different optimization, so it is
never chosen unasked. `asynchronous=True` is that permission: schedule="2bw" needs it, and with
schedule="auto" the planner then weighs 2BW beside the synchronous schedules. The flag alone
changes nothing a synchronous schedule does, so it is refused with one (it would read as a promise).

2BW keeps a second version of every trained weight on its device (runtime/weight_versions.py), so
what moves weights elsewhere is refused with it: swapping state to host memory, a host optimizer,
weights split over tensor-parallel ranks (not built for two versions).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Protocol

from stagewise.ir.choices import Schedule
from stagewise.ir.errors import OptionError
from stagewise.passes.planner import Candidate
from stagewise.passes.swap import SwapMode

_SWAPS = (SwapMode.ON, SwapMode.ALL, SwapMode.PER_DEVICE)  # modes that swap whatever the memory


class AsyncOptions(Protocol):
    """The options these checks read (CompileOptions)."""

    @property
    def schedule(self) -> Schedule: ...
    @property
    def asynchronous(self) -> bool: ...
    @property
    def swap(self) -> SwapMode: ...
    @property
    def optimizer_on_host(self) -> bool: ...
    @property
    def tensor_parallel(self) -> int: ...


def check_asynchronous(options: AsyncOptions) -> None:
    """`asynchronous` a bool that agrees with the schedule; 2BW without what it cannot run with."""
    if not isinstance(options.asynchronous, bool):
        raise OptionError(f"asynchronous={options.asynchronous!r} must be True or False "
                          f"(a bool, not {type(options.asynchronous).__name__})")
    schedule = options.schedule
    if schedule.asynchronous and not options.asynchronous:
        raise OptionError(f"schedule='{schedule}' updates with gradients one step stale (W(t+1) = W(t) - lr * "
                          "grad f(W(t-1)), Narayanan §3.2.1): training differs from synchronous SGD. Pass "
                          "asynchronous=True to accept that, or choose a synchronous schedule such as '1f1b'")
    if options.asynchronous and schedule != Schedule.AUTO and not schedule.asynchronous:
        raise OptionError(f"asynchronous=True lets schedule='auto' weigh '2bw'; schedule='{schedule}' is "
                          "synchronous, so it changes nothing: drop asynchronous=True, or ask for schedule='2bw'")
    if schedule.asynchronous:
        _check_two_versions_fit(options)


def _check_two_versions_fit(options: AsyncOptions) -> None:
    """2BW's second weight version lives on the device: nothing may move its weights elsewhere."""
    if options.swap in _SWAPS:
        raise OptionError(f"schedule='2bw' keeps two versions of every weight on its device; swap='{options.swap}' "
                          "moves weights to host memory between uses, which 2bw does not support: use "
                          "swap='auto' or 'off' (more devices if they do not fit), or schedule='1f1b' with swapping")
    if options.optimizer_on_host:
        raise OptionError("schedule='2bw' updates its two weight versions on the device; optimizer_on_host=True "
                          "steps host masters, which 2bw does not support: drop optimizer_on_host, or use "
                          "schedule='1f1b'")
    if options.tensor_parallel > 1:
        raise OptionError(f"schedule='2bw' with tensor_parallel={options.tensor_parallel} is not supported "
                          "(two versions of split weights are not built): use tensor_parallel=1, or a "
                          "synchronous schedule such as '1f1b'")


def two_bw_candidates(tried: Sequence[Candidate]) -> list[Candidate]:
    """For schedule="auto" with asynchronous=True: 2BW at each 1F1B candidate's counts and layout (its
    order is 1F1B's; stages replicated unevenly run GPipe or 1F1B-RR only)."""
    return [replace(c, schedule=Schedule.TWO_BW) for c in tried
            if c.schedule == Schedule.ONE_F_ONE_B and not c.replicates_stages]
