"""The baseline splits bench/plan_quality.py compares with the planner's: equal layer counts per
stage (DeepSpeed "uniform") and balanced parameter counts (DeepSpeed "parameters"), at legal cuts.

Not a benchmark itself. The script imports it as `_quality_splits` (bench/ is on sys.path when a
script in it runs).
"""

from __future__ import annotations

import bisect
from itertools import accumulate


def legal_starts(plan) -> list[int]:
    """Layers a stage may begin at (after a legal cut)."""
    return [c.after + 1 for c in plan.cuts if c.legal]


def uniform_starts(plan, stages: int) -> list[int]:
    """Equal layer counts per stage (round(i L / n)), each start moved to the nearest legal one."""
    legal, n_layers = legal_starts(plan), len(plan.layers)
    starts = [0]
    for s in range(1, stages):
        wanted = round(s * n_layers / stages)
        later = [a for a in legal if a > starts[-1] and len(legal) - legal.index(a) >= stages - s]
        starts.append(min(later, key=lambda a: (abs(a - wanted), a)))
    return starts


def parameter_starts(plan, stages: int) -> list[int]:
    """DeepSpeed's partition_balanced on parameter counts: binary search on the largest stage's
    parameter count, then fill stages greedily from the left (only at legal cuts)."""
    weights = [layer.param_bytes for layer in plan.layers]
    legal = set(legal_starts(plan))
    prefix = [0, *accumulate(weights)]

    def probe(limit: float) -> list[int] | None:
        starts = [0]
        while True:
            begin = starts[-1]
            end = bisect.bisect_right(prefix, prefix[begin] + limit) - 1  # layers begin..end-1 fit
            if end >= len(weights):
                return starts
            choices = [a for a in legal if begin < a <= end]
            if not choices or len(starts) == stages:
                return None
            starts.append(max(choices))

    lo, hi = max(weights) - 1, float(sum(weights))
    while hi - lo > max(1.0, 1e-6 * hi):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if probe(mid) is not None else (mid, hi)
    starts = probe(hi)
    for a in sorted(legal, reverse=True):  # use every device, as DeepSpeed does with empty-tail parts
        if len(starts) == stages:
            break
        if a not in starts:
            starts = sorted([*starts, a])
    return starts


def names(plan, starts: list[int]) -> list[str]:
    return [plan.layers[s].name for s in starts[1:]]
