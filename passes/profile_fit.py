"""A layer's costs as functions of the microbatch size, fitted through measured probes.

Srifty §3: latency in the microbatch size u is t(u) = αu + β, with slopes that change from
the latency-bound to the throughput-bound range, so the model is piecewise linear, fitted
from about four probes. Each layer gets one such fit per quantity (forward, backward,
recompute seconds; output, stash and workspace bytes); `LayerProfile.cost(u)` reads them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace

import numpy as np

from stagewise.ir.choices import CostModel
from stagewise.ir.plan import Layer, LayerCost

TIMES = ("fwd_s", "bwd_s", "recompute_s")
SIZES = ("act_bytes", "stash_bytes", "workspace_bytes")


@dataclass(frozen=True)
class PiecewiseLinear:
    """y(x) through the knots (xs, ys), extended past both ends along the end segments.

    One knot gives y proportional to x (no intercept can be told apart from one point).
    """

    xs: tuple[float, ...]
    ys: tuple[float, ...]

    @classmethod
    def fit(cls, xs: Sequence[float], ys: Sequence[float]) -> PiecewiseLinear:
        """Knots at the probes, made non-decreasing (a running maximum): a larger microbatch
        never costs less, so a dip is measurement noise. Repeated xs are averaged."""
        by_x: dict[float, list[float]] = {}
        for x, y in zip(xs, ys, strict=True):
            by_x.setdefault(float(x), []).append(float(y))
        knots = sorted((x, sum(v) / len(v)) for x, v in by_x.items())
        if not knots:
            raise ValueError("PiecewiseLinear.fit needs at least one probe")
        monotone = np.maximum.accumulate([y for _, y in knots])
        return cls(tuple(x for x, _ in knots), tuple(float(y) for y in monotone))

    def __call__(self, x: float) -> float:
        xs, ys = self.xs, self.ys
        if len(xs) == 1:
            return ys[0] * x / xs[0] if xs[0] else ys[0]
        if x <= xs[0]:
            y = ys[0] + (x - xs[0]) * (ys[1] - ys[0]) / (xs[1] - xs[0])
        elif x >= xs[-1]:
            y = ys[-1] + (x - xs[-1]) * (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
        else:
            y = float(np.interp(x, xs, ys))
        return max(y, 0.0)


@dataclass(frozen=True)
class LayerProfile:
    """One layer's costs as functions of the microbatch size u; `cost(u)` gives a LayerCost.

    `signature` is the structural hash shared by identical layers; `probes` the measured
    points (empty for analytic profiles); `max_microbatch` the largest u that fits the device
    (None when no capacity was given).
    """

    layer: int
    name: str
    signature: str
    source: CostModel  # measured here or derived from FLOPs
    param_bytes: int
    grad_bytes: int
    optim_bytes: int
    fwd_s: PiecewiseLinear
    bwd_s: PiecewiseLinear
    recompute_s: PiecewiseLinear
    act_bytes: PiecewiseLinear
    stash_bytes: PiecewiseLinear
    workspace_bytes: PiecewiseLinear
    probes: tuple[LayerCost, ...] = ()
    max_microbatch: int | None = None
    # forward (and recompute) and backward times are the layer's own probes times these (in_context_factors)
    context_fwd: float = 1.0
    context_bwd: float = 1.0

    def cost(self, u: int) -> LayerCost:
        return LayerCost(
            layer=self.layer,
            u=int(u),
            fwd_s=self.fwd_s(u),
            bwd_s=self.bwd_s(u),
            recompute_s=self.recompute_s(u),
            param_bytes=self.param_bytes,
            grad_bytes=self.grad_bytes,
            optim_bytes=self.optim_bytes,
            act_bytes=round(self.act_bytes(u)),
            stash_bytes=round(self.stash_bytes(u)),
            workspace_bytes=round(self.workspace_bytes(u)),
        )

    @classmethod
    def from_probes(cls, layer: Layer, signature: str, probes: Sequence[LayerCost],
                    max_microbatch: int | None = None) -> LayerProfile:
        """Fit one piecewise-linear model per quantity through the measured probes."""
        xs = [p.u for p in probes]

        def fit(quantity: str) -> PiecewiseLinear:
            return PiecewiseLinear.fit(xs, [getattr(p, quantity) for p in probes])

        first = probes[0]
        return cls(layer.index, layer.name, signature, CostModel.PROFILE, first.param_bytes, first.grad_bytes,
                   first.optim_bytes, fwd_s=fit("fwd_s"), bwd_s=fit("bwd_s"), recompute_s=fit("recompute_s"),
                   act_bytes=fit("act_bytes"), stash_bytes=fit("stash_bytes"), workspace_bytes=fit("workspace_bytes"),
                   probes=tuple(probes), max_microbatch=max_microbatch)

    def in_context(self, fwd: float, bwd: float) -> LayerProfile:
        """The same profile with its forward and recompute times (fits and probes) multiplied by
        `fwd`, its backward times by `bwd`."""
        factor = {"fwd_s": fwd, "recompute_s": fwd, "bwd_s": bwd}
        fits = {k: replace(getattr(self, k), ys=tuple(y * factor[k] for y in getattr(self, k).ys)) for k in TIMES}
        probes = tuple(replace(p, **{k: getattr(p, k) * factor[k] for k in TIMES}) for p in self.probes)
        return replace(self, probes=probes, context_fwd=self.context_fwd * fwd, context_bwd=self.context_bwd * bwd,
                       **fits)

    def for_layer(self, layer: Layer) -> LayerProfile:
        """The same profile for an identical layer elsewhere in the model."""
        probes = tuple(replace(p, layer=layer.index) for p in self.probes)
        return replace(self, layer=layer.index, name=layer.name, probes=probes)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> LayerProfile:
        data = dict(data)
        for key in TIMES + SIZES:
            data[key] = PiecewiseLinear(tuple(data[key]["xs"]), tuple(data[key]["ys"]))
        data["probes"] = tuple(LayerCost(**p) for p in data["probes"])
        data["source"] = CostModel(data["source"])  # a cache file holds its string
        return cls(**data)


def costs_at(profiles: Sequence[LayerProfile], u: int) -> list[LayerCost]:
    """Every layer's LayerCost at microbatch size u (what the partitioner reads)."""
    return [p.cost(u) for p in profiles]
