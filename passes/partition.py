"""First partitioner: balanced contiguous stages from a simple cost estimate.

Each layer costs its share of the model's forward FLOPs plus its share of the parameter
bytes (so a FLOP-free embedding still weighs what it stores). Stages are contiguous and
start only after legal cuts; the split minimises the most expensive stage (binary search
over the bottleneck with a greedy feasibility check, optimal for contiguous partitions).
The full planner (profiled costs, DP, CP-SAT) replaces this pass, but for the schedules that place
their own stages (interleaved, zb-v): `balanced_at_legal_cuts` splits by profiled time, Harmony's way.
"""

from __future__ import annotations

from stagewise.ir.errors import PartitionError
from stagewise.ir.plan import Cut, Layer
from stagewise.passes.harmony_packing import split_balanced


def layer_costs(layers: tuple[Layer, ...]) -> list[float]:
    flops = sum(layer.flops for layer in layers) or 1
    params = sum(layer.param_bytes for layer in layers) or 1
    return [layer.flops / flops + layer.param_bytes / params + 1e-9 for layer in layers]


def balanced_starts(layers: tuple[Layer, ...], cuts: tuple[Cut, ...], n_stages: int,
                    costs: list[float] | None = None) -> list[int]:
    """First layer of each of `n_stages` stages, minimising the bottleneck stage cost
    (`costs` per layer, default the FLOP-and-parameter estimate)."""
    legal = [c.after + 1 for c in cuts if c.legal]  # a stage may start at these layers
    if n_stages - 1 > len(legal):
        raise PartitionError(
            f"cannot split the model into {n_stages} stages: it has only {len(legal)} legal cut-points "
            f"({len(legal) + 1} stages at most). Use at most {len(legal) + 1} devices, or make the model's "
            "blocks finer-grained modules."
        )
    costs = [c + 1e-12 for c in costs] if costs is not None else layer_costs(layers)
    lo, hi = max(costs), sum(costs)
    for _ in range(60):
        mid = (lo + hi) / 2
        if _greedy(costs, legal, n_stages, mid) is None:
            lo = mid
        else:
            hi = mid
    starts = _greedy(costs, legal, n_stages, hi)
    assert starts is not None, hi  # hi only takes limits _greedy met, first the whole model's cost (one stage)
    return _fill(starts, legal, n_stages)


def _greedy(costs: list[float], legal: list[int], n_stages: int, limit: float) -> list[int] | None:
    """Stage starts if every stage can stay within `limit` using at most n_stages stages."""
    starts, begin, acc, last_legal = [0], 0, 0.0, None
    legal_set = set(legal)
    i = 0
    while i < len(costs):
        if i in legal_set and i > begin:
            last_legal = i
        if acc + costs[i] > limit * (1 + 1e-12):
            if last_legal is None or last_legal <= begin:
                return None
            starts.append(last_legal)
            begin, acc, last_legal = last_legal, 0.0, None
            i = begin
            continue
        acc += costs[i]
        i += 1
    return starts if len(starts) <= n_stages else None


def _fill(starts: list[int], legal: list[int], n_stages: int) -> list[int]:
    """Use every device: split further at legal cuts while fewer stages than devices."""
    starts = list(starts)
    for position in legal:
        if len(starts) == n_stages:
            break
        if position not in starts:
            starts.append(position)
    return sorted(starts)


def starts_from_split_points(layers: tuple[Layer, ...], cuts: tuple[Cut, ...], split_points: list[str]) -> list[int]:
    """The user's cuts: each name is the module where a new stage begins."""
    starts = [0]
    for name in split_points:
        matches = [layer.index for layer in layers if layer.name == name or layer.name.startswith(name + ".")]
        if not matches:
            known = ", ".join(layer.name for layer in layers[:12])
            raise PartitionError(
                f"split_points names {name!r}, which is not a layer boundary of the model. "
                f"Name a module where a layer begins, e.g. one of: {known}{', ...' if len(layers) > 12 else ''}"
            )
        start = matches[0]
        if start == 0:
            raise PartitionError(f"split_points names {name!r}, the first layer: a stage must begin after it")
        cut = cuts[start - 1]
        if not cut.legal:
            raise PartitionError(f"cannot cut before {name!r}: {cut.reason}. Choose another module.")
        if start <= starts[-1]:
            raise PartitionError(f"split_points must be distinct and in model order; {name!r} is not")
        starts.append(start)
    return starts


def balanced_at_legal_cuts(times: list[float], legal: list[bool], count: int, layers: tuple[Layer, ...],
                           cuts: tuple[Cut, ...]) -> list[int]:
    """Harmony's balanced time packing (Alg. 2 l. 7-11), each start moved to the nearest legal cut (the
    interleaved and zb-v stages); `balanced_starts` where too few legal cuts are left."""
    packs = split_balanced(times, count)
    starts = [0]
    allowed = [i + 1 for i, ok in enumerate(legal) if ok]
    for pack in packs[1:]:
        later = [a for a in allowed if a > starts[-1]]
        if not later:
            break
        starts.append(min(later, key=lambda a: abs(a - pack.start)))
    if len(starts) < count:
        return balanced_starts(layers, cuts, count)
    return starts
