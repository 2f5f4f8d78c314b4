"""The zero-bubble candidates `schedule="auto"` weighs: derived from the straight schedules' best, not searched anew.

ZB-H1 runs 1F1B's split and microbatches with each backward split into B and W (Qi et al. §2.1), and ZB-V
(§6) runs interleaved's two stages per device in a V: each is worth simulating where its parent schedule is
at its best, since the split changes only the order of the passes, not what a stage computes. So the
planner first scores its usual candidates, then only these few: ZB-H1 at the fastest fitting 1F1B
candidate's microbatch count, replicas and depth (same partition: the DP's, shared per size), ZB-V at the
microbatch counts of the fastest fitting 1F1B and interleaved candidates. Compile time grows by two or three
builds instead of doubling the search. The choice among all is then made again among these and the first
round's candidates within the planner's margin of its fastest (`finalists`): a plan within the margin of a
faster zero-bubble plan is within it of the first round's fastest too, so no other can be kept, and only
those few are simulated again.

On a CPU the split's Python (runtime/split_backward.py: hooks on the frontier, a walk of the graph, an
autograd call per group of weights) adds a time per backward to the compute (two GPT blocks at d=32, 8
tokens: 0.82 ms whole, 6.33 ms split on this 2-core machine; at d=256 nothing), which the profile does not
see: compile measures it per layer kind (compiler/compile/split_backward_cost.py) and the simulator charges
it, so auto keeps a zero-bubble plan on a CPU only where it is predicted faster with that time (TinyGPT on
2 CPU devices, where zb-h1 measured 21.9 ms a step against gpipe's 15.5 ms, stays on gpipe). Not weighed
where each stage's backward runs whole (compile_stages, cuda_graphs).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from stagewise.ir.choices import Schedule
from stagewise.passes.harmony_search import Tried
from stagewise.passes.planner import PLAN_MARGIN, Candidate, Prediction


def weighs_split_backward(whole_backward: bool) -> bool:
    """Whether auto weighs a split backward: not where an option runs each stage's backward whole
    (compile_stages, cuda_graphs: compiler/assembly/stage_acceleration.py)."""
    return not whole_backward


def zero_bubble_candidates(tried: Sequence[Tried], n_devices: int, legal_cuts: int, v_allowed: bool) -> list[Candidate]:
    """ZB-H1 and ZB-V candidates from the scored `tried` rows (none where no 1F1B or interleaved row fits).
    `v_allowed`: ZB-V may run here (not under a backend that pairs messages by order: runtime/links.py)."""
    flush, interleaved = _fastest(tried, Schedule.ONE_F_ONE_B), _fastest(tried, Schedule.INTERLEAVED)
    derived: list[Candidate] = []
    if flush is not None and not flush.replicates_stages:
        derived.append(Candidate(Schedule.ZB_H1, flush.microbatches, flush.replicas, flush.stages))
    if v_allowed and 2 * n_devices <= legal_cuts + 1:
        counts = [c.microbatches for c in (flush, interleaved) if c is not None]
        derived += [Candidate(Schedule.ZB_V, m) for m in dict.fromkeys(counts)]
    return derived


def _fastest(tried: Sequence[Tried], schedule: Schedule) -> Candidate | None:
    """The fastest candidate of `schedule` whose plan fits."""
    fitting = [(result.iteration_s, i) for i, (option, result) in enumerate(tried)
               if option.schedule == schedule and isinstance(result, Prediction) and result.fits]
    return tried[min(fitting)[1]][0] if fitting else None


def finalists(tried: Sequence[Tried]) -> list[Candidate]:
    """The candidates of `tried` that fit within PLAN_MARGIN of the fastest that fits, as they were asked for
    (a row of PipeDream's DP names the replication it found)."""
    fitting = [(option, result.iteration_s) for option, result in tried if isinstance(result, Prediction) and result.fits]
    bound = min((seconds for _, seconds in fitting), default=0.0) * (1 + PLAN_MARGIN)
    return [replace(option, stage_replicas=()) if option.dp_replication else option
            for option, seconds in fitting if seconds <= bound]
