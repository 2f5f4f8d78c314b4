"""Per-stage activation policy: keep a stage's stashes, recompute them (Varuna §3.2) or swap them to host
memory (Harmony's sX), chosen by cost.

Why per stage: the stashes a schedule keeps in flight differ by stage (1F1B's stage s holds p - s of
them, its last stage one), so one device may need relief while another keeps everything, and the
cheaper relief depends on the stage: recompute costs one more forward per microbatch, a swap its
stash's bytes over the host link less what overlaps compute. The planner keeps a stage's stashes
where they fit; for the others it simulates the choices (the simulator charges the extra forward,
the link time and its overlap, and the peak memory of each): all of them recomputing, all swapping,
then each stage in turn; it keeps what fits and is fastest, so a plan that fits only with recompute
is found rather than refused.

Harmony's packs take a policy too (Harmony §4.3.1 recomputes every pack's forward before its
backward): one device runs every pack in turn while their state streams through the host link,
so a swapped stash competes with that state for the same link (a 1.3 B GPT on one capped GPU
moved 315 GB per step, stashes 87% of it, where recomputing costs a third more forward). There
the choice is one policy for every pack that stashes (keep as the swap mode says, recompute all,
swap all): Alg. 1 scores many configurations, and a per-pack search would build each once per pack.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from stagewise.ir.choices import ActivationPolicy, Schedule
from stagewise.ir.instructions import Phase
from stagewise.ir.plan import Stage, Task
from stagewise.passes.schedule import stashes_held_once, with_recompute
from stagewise.passes.swap import SwapPlan

if TYPE_CHECKING:
    from stagewise.passes.planner import Assembled

PER_STAGE_SCHEDULES = (Schedule.GPIPE, Schedule.ONE_F_ONE_B, Schedule.TWO_BW, Schedule.ZB_H1, Schedule.INTERLEAVED,
                       Schedule.ZB_V, Schedule.HARMONY_PP, Schedule.HARMONY_DP)  # the schedules that take a policy
Policies = Mapping[int, ActivationPolicy]  # per stage instance; a stage not named keeps its stashes


def asked_policies(asked: ActivationPolicy | Policies, stages: Sequence[Stage],
                   tasks: Sequence[Sequence[Task]]) -> Policies | None:
    """Each stage's policy for `activations=` (None for AUTO: the swap mode decides as it always has).
    RECOMPUTE spares the stages that hold one stash at a time anyway (1F1B's last stage)."""
    if isinstance(asked, Mapping):
        return {s.index: asked.get(s.index, ActivationPolicy.KEEP) for s in stages}
    if asked is ActivationPolicy.AUTO:
        return None
    if asked is ActivationPolicy.RECOMPUTE:
        once = stashes_held_once(tasks)
        return {s.index: ActivationPolicy.KEEP if s.index in once else asked for s in stages}
    return {s.index: asked for s in stages}


def apply_policies(tasks: list[list[Task]], policies: Policies | None) -> tuple[list[list[Task]], frozenset[int] | None]:
    """The tasks with the RECOMPUTE stages recomputing, and the stages whose stashes are swapped (None:
    as the swap mode says)."""
    if policies is None:
        return tasks, None
    recompute = {s for s, policy in policies.items() if policy is ActivationPolicy.RECOMPUTE}
    swap = frozenset(s for s, policy in policies.items() if policy is ActivationPolicy.SWAP)
    return (with_recompute(tasks, recompute) if recompute else tasks), swap


def recorded_policies(stages: Sequence[Stage], tasks: Sequence[Sequence[Task]], swaps: SwapPlan) -> tuple[Stage, ...]:
    """The stages with the policy their programs run (Varuna's recompute and Harmony's swapped stashes
    included), what the plan records and its table shows."""
    recomputing = {t.stage for device_tasks in tasks for t in device_tasks if t.phase is Phase.RECOMPUTE}

    def policy(stage: int) -> ActivationPolicy:
        if stage in recomputing:
            return ActivationPolicy.RECOMPUTE
        return ActivationPolicy.SWAP if swaps.swaps_stash(stage) else ActivationPolicy.KEEP

    return tuple(replace(s, activations=policy(s.index)) for s in stages)


@dataclass(frozen=True)
class Scored:
    """A candidate with what the simulator predicts for it."""

    plan: Assembled
    iteration_s: float
    peak_bytes: tuple[int, ...]  # per device
    capacities: tuple[int | None, ...]  # per device; None: unbounded

    @property
    def over(self) -> tuple[int, ...]:
        """Per device, the bytes its peak exceeds its memory by (0 where it fits)."""
        return tuple(0 if cap is None else max(peak - cap, 0) for peak, cap in zip(self.peak_bytes, self.capacities,
                                                                                 strict=True))

    def better_than(self, other: Scored, device: int, relieves_both: bool) -> bool:
        """Whether this is the better choice for a stage on `device`: a plan that fits first. Between
        keeping and a relief, then the one whose device overflows less (the relief may lead to a fit);
        between two reliefs (recompute, swap), whether the device fits, since their other differences in
        memory are side effects such as the next stage's receive buffers. Then the faster. Never the
        worst device's overflow: a device over whatever this stage does would make the slowest stay."""
        if any(self.over) != any(other.over):
            return not any(self.over)
        mine, theirs = self.over[device], other.over[device]
        if relieves_both and (mine > 0) != (theirs > 0):
            return mine == 0
        if not relieves_both and mine != theirs:
            return mine < theirs
        return self.iteration_s < other.iteration_s


def choose_policies(first: Scored, build: Callable[[Policies], Scored], swap_allowed: bool,
                    per_stage: bool = True) -> Scored:
    """The stages that need relief (`needing_relief`) all recomputing, or all swapping, where that fits
    or is faster (one stage alone seldom is: the slowest stage's swaps set the pace); then, `per_stage`,
    greedy over them, in order: each takes whichever of keep, recompute and swap gives the best plan
    with the others' choices so far. Without `per_stage` (Harmony's packs) every stage that stashes
    is relieved alike, or none."""
    reliefs = [ActivationPolicy.RECOMPUTE] + ([ActivationPolicy.SWAP] if swap_allowed else [])
    choices = [ActivationPolicy.KEEP, *reliefs]
    needing = needing_relief(first) if per_stage else stashing(first)
    best = first
    policies = {s.index: s.activations for s in first.plan.stages}
    for relief in reliefs:
        uniform = {**policies, **dict.fromkeys(needing, relief)}
        if uniform == policies:  # the swap mode chose this already: `first` is that plan
            continue
        trial = build(uniform)
        if (any(trial.over), trial.iteration_s) < (any(best.over), best.iteration_s):
            best = trial
    if not per_stage:
        return best
    for stage in needing:
        policies = {s.index: s.activations for s in best.plan.stages}
        device = next(s.device for s in best.plan.stages if s.index == stage)
        held = policies[stage]
        for choice in choices:
            if held is not choice:
                trial = build({**policies, stage: choice})
                if trial.better_than(best, device, ActivationPolicy.KEEP not in (held, choice)):
                    best, held = trial, choice
    return best


def stashing(scored: Scored) -> list[int]:
    """The stages that stash anything."""
    stash = scored.plan.swaps.stash_bytes
    return sorted(s.index for s in scored.plan.stages if stash.get(s.index, 0) > 0)


def needing_relief(scored: Scored) -> list[int]:
    """The stages whose stashes the swap mode moved to host memory, and every stage that stashes on a
    device the plan overflows: where keeping the stashes did not fit."""
    stash = scored.plan.swaps.stash_bytes
    return sorted(s.index for s in scored.plan.stages if stash.get(s.index, 0) > 0
                  and (s.activations is not ActivationPolicy.KEEP or scored.over[s.device] > 0))
