"""Measure each layer's time and memory over microbatch sizes (cost="profile").

Harmony §4.2: the profiler runs every layer on its own, on one device, and records compute
time, memory footprint and tensor sizes. Profiling every microbatch size is too slow, so it
first finds the largest microbatch that does not run out of memory, the way TCP's slow start
finds a window: double until the first OOM, fall back to the last size that fit, then add
(here: add a step that halves at each further OOM, which lands on the exact largest size).
It then profiles a few sizes up to that maximum and interpolates the rest.

Srifty §3: latency in the microbatch size u is t(u) = αu + β, with slopes that change from
the latency-bound to the throughput-bound range, so the model is piecewise linear, fitted
from about four probes. Each layer gets one such fit per quantity (forward, backward,
recompute seconds; output, stash and workspace bytes); `LayerProfile.cost(u)` reads them.

Layers run alone are faster than in a stage: a probe repeats one layer on the same inputs, so
its weights and activations stay in cache. All layers are then run back to back at the traced
size, forwards in order and backwards in reverse, each timed: the ratio to its probe scales
the layer's times (the in-context time PipeDream §2.4.1 measures inside whole iterations).

Two things keep it cheap. Layers with the same structure (the repeated blocks of a
transformer) are profiled once. Shapes and memory at a size u come from fake tensors
(torch's FakeTensorMode: shapes and dtypes, no storage), so the search for the largest
microbatch allocates nothing; only the few probed sizes are run for real. Profiles are
cached on disk, keyed by the graph's structure, the device and the torch version.

Memory. The stash is what autograd saves for the backward (counted with
saved_tensors_hooks; parameters excluded). The workspace is measured on CUDA (the peak
allocation of a forward or backward above both its start and its end) and estimated on CPU
as the layer's largest single intermediate. A size "does not fit" when one layer run alone
(parameters, buffers, gradients, input, stash, output, workspace) needs more than the
capacity; on CUDA a real OOM at a probe also ends that layer's probes.

Limits. Inputs are synthetic (normal floats, integers in {0, 1}, all-True masks): a layer
whose speed depends on the values (sparse routing) is timed on typical-looking data only.
A graph captured by torch.export with static shapes runs only at its traced size; it is
probed there alone and its costs scale in proportion to u.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.fx as fx
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.node import _get_qualified_name, map_arg
from torch.utils._pytree import tree_flatten, tree_map

from stagewise.ir.devices import Device, parse_bytes, resolve_devices
from stagewise.ir.errors import StagewiseError
from stagewise.ir.plan import Layer, LayerCost
from stagewise.ir.subgraph import attribute, extract

N_PROBES = 4  # Srifty §5: four probed sizes were enough for 4.5-6.4% error
MAX_MICROBATCH = 4096  # the slow-start search stops here when memory never runs out
OPTIMIZER_STATE_FACTOR = 2.0  # AdamW keeps two moments per parameter
REPEATS = 3
CACHE_VERSION = 2
CONTEXT_REPEATS = 9  # passes timed for the factors: with 3 a whole-graph factor spread 0.97-1.59 here, with 9 1.03-1.12
CONTEXT_MIN_REPEATS = 3  # ... but past CONTEXT_BUDGET_S of passes, this many do (a large model's identical
CONTEXT_BUDGET_S = 1.0  # layers, each timed once a pass, still give their shared factor many samples)
CONTEXT_RANGE = (0.5, 2.0)  # an in-context / alone ratio outside this is a disturbed measurement
TIMES = ("fwd_s", "bwd_s", "recompute_s")
SIZES = ("act_bytes", "stash_bytes", "workspace_bytes")


class ProfileError(StagewiseError):
    """A layer cannot be profiled: it fails on synthetic inputs or does not fit even at u=1."""


# ---- piecewise-linear model (Srifty §3) --------------------------------------------------------
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


# ---- per-layer profile ---------------------------------------------------------------------------
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
    source: str  # "profile" | "analytic"
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
        fits = {k: PiecewiseLinear.fit(xs, [getattr(p, k) for p in probes]) for k in TIMES + SIZES}
        first = probes[0]
        return cls(layer.index, layer.name, signature, "profile", first.param_bytes, first.grad_bytes,
                   first.optim_bytes, probes=tuple(probes), max_microbatch=max_microbatch, **fits)

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
        return cls(**data)


def costs_at(profiles: Sequence[LayerProfile], u: int) -> list[LayerCost]:
    """Every layer's LayerCost at microbatch size u (what the partitioner reads)."""
    return [p.cost(u) for p in profiles]


# ---- entry point ---------------------------------------------------------------------------------
def profile_layers(
    gm: fx.GraphModule,
    layers: Sequence[Layer],
    device: str | torch.device | Device = "cpu",
    microbatch_sizes: Sequence[int] | None = None,
    capacity: int | str | None = None,
    quiet: bool = False,
    *,
    traced_microbatch: int | None = None,
    optimizer_state_factor: float = OPTIMIZER_STATE_FACTOR,
    repeats: int = REPEATS,
    max_microbatch: int = MAX_MICROBATCH,
    cache: bool = True,
    graph_at: Callable[[int], fx.GraphModule] | None = None,
) -> list[LayerProfile]:
    """Profile every layer of `gm` on `device` (Harmony §4.2) and fit costs in u (Srifty §3).

    capacity (default: the device's `memory`) bounds the microbatch: the slow-start search
    finds the largest u whose every layer fits, and the default probes spread over 1..that u.
    Without a capacity the default probes spread over 1..traced microbatch size.
    `microbatch_sizes` picks the probes instead (those that do not fit are dropped).
    `graph_at(u)`: the graph at microbatch size u, for graphs that run at their traced size only
    (torch.export's): each probe size is then measured on a graph of its own.
    """
    device = resolve_devices(device)[0]
    capacity = parse_bytes(capacity) if capacity is not None else device.memory
    traced = traced_microbatch or traced_microbatch_size(gm)
    signatures = [layer_signature(gm, layer) for layer in layers]
    request = dict(sizes=list(microbatch_sizes or ()), capacity=capacity, traced=traced, repeats=repeats,
                   optim=optimizer_state_factor, limit=max_microbatch)
    key = cache_key(gm, layers, signatures, device, request)
    if cache and (hit := _load(key)) is not None and not _measured_under_load(hit, gm, layers, traced, device):
        return hit

    shapes = _ShapeCache(gm, layers, traced, graph_at)
    state = [layer_state_bytes(gm, layer, optimizer_state_factor) for layer in layers]
    largest = None
    if capacity is not None:
        largest = slow_start(lambda u: _fits(shapes.at(u), state, capacity), max_microbatch)
        if largest == 0:
            raise _does_not_fit(shapes.at(1), state, layers, capacity, device)
    sizes = _probe_list(microbatch_sizes, largest or traced, largest, shapes)

    first_of: dict[str, int] = {}
    for layer, sig in zip(layers, signatures, strict=True):
        first_of.setdefault(sig, layer.index)
    unique = [layers[i] for i in first_of.values()]
    measured = _profile_unique(gm, unique, sizes, shapes, state, device, repeats, quiet)
    measured_top = min(max(p.u for p in probes) for probes in measured.values())
    if measured_top < max(sizes):  # a real OOM cut some layer's probes short
        largest = measured_top

    by_sig = {
        signatures[i]: LayerProfile.from_probes(layers[i], signatures[i], measured[i], largest)
        for i in first_of.values()
    }
    profiles = [by_sig[sig].for_layer(layer) for layer, sig in zip(layers, signatures, strict=True)]
    factors = in_context_factors(gm, layers, profiles, shapes.at(traced), device, max(repeats, CONTEXT_REPEATS))
    profiles = [p.in_context(*f) for p, f in zip(profiles, factors, strict=True)]
    if cache:
        _save(key, profiles)
    return profiles


def traced_microbatch_size(gm: fx.GraphModule) -> int:
    """The batch (dim 0) of the first tensor graph input: the size the graph was traced at."""
    for node in gm.graph.nodes:
        value = node.meta.get("val")
        if node.op == "placeholder" and isinstance(value, torch.Tensor) and value.dim() > 0:
            return int(value.shape[0])
    raise ProfileError("the traced graph has no tensor input with a batch dimension to vary")


def _probe_list(requested: Sequence[int] | None, top: int, largest: int | None,
                shapes: _ShapeCache) -> list[int]:
    """The sizes to run: requested or spread over 1..top, within the largest that fits, and
    only sizes the graph can run at (a static-shape graph: its traced size alone)."""
    sizes = sorted({int(u) for u in requested}) if requested else list(probe_sizes(top))
    if any(u < 1 for u in sizes):
        raise ProfileError(f"microbatch sizes must be positive, got {sizes}")
    fitting = [u for u in sizes if largest is None or u <= largest] or [largest]
    runnable = [u for u in fitting if shapes.at(u).exact]
    return runnable or [shapes.traced]


def probe_sizes(top: int, n: int = N_PROBES) -> tuple[int, ...]:
    """About n sizes spread geometrically over 1..top, both ends included (Harmony: 'from 1 to
    this max size'; Srifty: four probes)."""
    if top <= 1:
        return (1,)
    return tuple(sorted({round(top ** (k / (n - 1))) for k in range(n)}))


# ---- slow start (Harmony §4.2) -------------------------------------------------------------------
def slow_start(fits: Callable[[int], bool], limit: int = MAX_MICROBATCH) -> int:
    """The largest u in 1..limit with fits(u) (fits must be monotone); 0 if not even 1 fits.

    Multiplicative increase until the first OOM, back to the last size that fit, then additive
    increase whose step halves at each further OOM, which ends on the exact largest size.
    """
    if not fits(1):
        return 0
    u = 1
    while u < limit and fits(min(2 * u, limit)):
        u = min(2 * u, limit)
    if u == limit:
        return u
    oom = min(2 * u, limit)  # the smallest size known not to fit
    step = max(u // 2, 1)
    while step >= 1:
        if u + step < oom and fits(u + step):
            u += step
        else:
            oom = min(oom, u + step)
            step //= 2
    return u


def _fits(shapes: _Shapes, state: Sequence[LayerState], capacity: int) -> bool:
    return max(_layer_need(shapes, state, i) for i in range(len(state))) <= capacity


def _layer_need(shapes: _Shapes, state: Sequence[LayerState], i: int) -> int:
    """Bytes one layer needs to run forward and backward on its own (Harmony's profiler runs each
    layer alone): its parameters, buffers and gradients, input, stash, output and workspace.
    The optimizer state is left out: Harmony updates it on the host."""
    s = state[i]
    return (s.param + s.grad + s.buffers + shapes.input_bytes[i] + shapes.stash_bytes[i]
            + shapes.act_bytes[i] + shapes.largest_bytes[i])


def _does_not_fit(shapes: _Shapes, state, layers, capacity: int, device: Device) -> ProfileError:
    need = [_layer_need(shapes, state, i) for i in range(len(layers))]
    worst = int(np.argmax(need))
    return ProfileError(
        f"layer {layers[worst].name!r} needs {need[worst]:,} bytes at microbatch size 1, more than the "
        f"{capacity:,} bytes of device {device.name!r}: give the device more memory "
        f"(sw.Device(..., memory=)) or split the module into smaller ones"
    )


# ---- the graph at microbatch size u, on fake tensors -----------------------------------------------
@dataclass
class _Shapes:
    """Every node's value at one microbatch size (fake tensors), and per-layer byte counts."""

    u: int
    values: dict[str, Any]
    input_bytes: list[int]
    act_bytes: list[int]
    stash_bytes: list[int]
    largest_bytes: list[int]  # the largest single intermediate: a workspace estimate
    exact: bool = True  # False: scaled from another size, no values to run a layer on
    graph: fx.GraphModule | None = None  # the graph at u, where the traced one runs at its own size only

    def scaled(self, u: int) -> _Shapes:
        """Byte counts at u by proportion, for a graph that only runs at the size it was traced at."""
        def scale(xs: list[int]) -> list[int]:
            return [round(x * u / self.u) for x in xs]

        return _Shapes(u, {}, scale(self.input_bytes), scale(self.act_bytes), scale(self.stash_bytes),
                       scale(self.largest_bytes), exact=False)


class _ShapeCache:
    """Shapes per microbatch size, computed once each.

    A graph captured by torch.export has the traced batch written into its view and reshape
    arguments and runs at that size only; `graph_at(u)` (the capture's graph at size u, with the
    same nodes) then gives each size a graph of its own. Without it other sizes get byte counts
    scaled from the traced size, and only the traced size is probed.
    """

    def __init__(self, gm: fx.GraphModule, layers: Sequence[Layer], traced: int,
                 graph_at: Callable[[int], fx.GraphModule] | None = None):
        self.gm, self.layers, self.traced, self.graph_at = gm, layers, traced, graph_at
        self._done: dict[int, _Shapes] = {}
        self.static = False  # set at the first size other than the traced one that fails

    def at(self, u: int) -> _Shapes:
        if u in self._done:
            return self._done[u]
        if u == self.traced:
            try:
                self._done[u] = shapes_at(self.gm, self.layers, u, self.traced)
            except Exception as err:  # noqa: BLE001 - reported as what it means for the user
                raise ProfileError(f"cannot propagate shapes through the traced graph: {err}; "
                                   f"use cost='analytic'") from err
        elif not self.static:
            try:
                with _quiet_fake_tensor_log():
                    self._done[u] = shapes_at(self.gm, self.layers, u, self.traced)
            except Exception:  # noqa: BLE001 - any failure: the graph is specialised to its size
                self.static = True
        if u not in self._done and self.graph_at is not None:
            try:
                graph = self.graph_at(u)
                self._done[u] = replace(shapes_at(graph, self.layers, u, u), graph=graph)
            except Exception:  # noqa: BLE001 - this size cannot be captured: scaled below
                pass
        if u not in self._done:
            self._done[u] = self.at(self.traced).scaled(u)
        return self._done[u]


@contextlib.contextmanager
def _quiet_fake_tensor_log():
    """FakeTensorMode logs a traceback for a shape mismatch that the caller expects and handles."""
    logger = logging.getLogger("torch._subclasses.fake_tensor")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def shapes_at(gm: fx.GraphModule, layers: Sequence[Layer], u: int, traced: int) -> _Shapes:
    """Run the whole graph on fake inputs whose batch is u: exact shapes of every value at u,
    and the bytes autograd saves per layer, without allocating them."""
    layer_of = {name: layer.index for layer in layers for name in layer.nodes}
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    # A module's Python forward may update a real buffer in place even on fake inputs
    # (BatchNorm's num_batches_tracked): keep the model as it was.
    buffers = {name: b.clone() for name, b in gm.named_buffers()}
    with mode, _restored(gm, buffers):
        # Autograd saves a real parameter as given, or a fake view of its (memoised) fake; both are
        # state, not stash. The fakes are kept alive so their storage ids stay valid.
        state = _state_tensors(gm)
        fake_state = [mode.from_tensor(t) for t in state]
        inputs = [_batched_fake(n.meta.get("val"), u, traced) for n in gm.graph.nodes if n.op == "placeholder"]
        recorder = _Recorder(gm, layer_of, {_sid(t) for t in (*state, *fake_state)})
        with torch.autograd.graph.saved_tensors_hooks(recorder.pack, lambda t: t):
            recorder.run(*inputs)
    values = recorder.values
    n = len(layers)
    return _Shapes(
        u=u,
        values=values,
        input_bytes=[sum(tree_bytes(values[v]) for v in layer.inputs) for layer in layers],
        act_bytes=[sum(tree_bytes(values[v]) for v in layer.outputs) for layer in layers],
        stash_bytes=[sum(recorder.saved[i].values()) for i in range(n)],
        largest_bytes=[max((tree_bytes(values[v]) for v in layer.nodes), default=0) for layer in layers],
    )


@contextlib.contextmanager
def _restored(gm: fx.GraphModule, buffers: dict[str, torch.Tensor]):
    try:
        yield
    finally:
        with torch.no_grad(), _no_fake_mode():
            for name, b in gm.named_buffers():
                b.copy_(buffers[name])


def _no_fake_mode():
    return torch._subclasses.fake_tensor.unset_fake_temporarily()


class _Recorder(fx.Interpreter):
    """Keeps every node's value and, per layer, the storages autograd saves (state excluded)."""

    def __init__(self, gm: fx.GraphModule, layer_of: dict[str, int], state_ids: set[int]):
        super().__init__(gm, garbage_collect_values=False)
        self.layer_of, self.state_ids = layer_of, state_ids
        self.values: dict[str, Any] = {}
        self.saved: dict[int, dict[int, int]] = {i: {} for i in set(layer_of.values())}
        self.current: int | None = None

    def run_node(self, n: fx.Node):
        self.current = self.layer_of.get(n.name)
        result = super().run_node(n)
        self.values[n.name] = result
        return result

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        sid = _sid(t)
        if self.current is not None and sid not in self.state_ids:
            self.saved[self.current][sid] = t.untyped_storage().nbytes()
        return t


def _batched_fake(value, u: int, traced: int):
    """A fake graph input like `value` with its batch dimension (dim 0) set to u."""
    if not isinstance(value, torch.Tensor):
        return value
    shape = list(value.shape)
    if shape and shape[0] == traced:
        shape[0] = u
    return torch.empty(shape, dtype=value.dtype, device=value.device, requires_grad=value.requires_grad)


# ---- one layer as a module -----------------------------------------------------------------------
def layer_module(gm: fx.GraphModule, layer: Layer) -> fx.GraphModule:
    """The layer's nodes as a GraphModule of their own, with a private copy of its state (so
    profiling leaves the model's gradients alone)."""
    return extract(gm, layer.nodes, layer.inputs, layer.outputs, class_name=f"Layer{layer.index}")


def layer_signature(gm: fx.GraphModule, layer: Layer) -> str:
    """A hash of what the layer computes, blind to names: ops, targets, argument structure,
    constants and shapes. blocks.1 and blocks.2 of a transformer hash alike."""
    by_name = {n.name: n for n in gm.graph.nodes}
    local = {name: f"in{k}" for k, name in enumerate(layer.inputs)}
    items: list = [tuple(_value_key(by_name[name].meta.get("val")) for name in layer.inputs)]
    for k, name in enumerate(layer.nodes):
        node = by_name[name]
        for arg in node.all_input_nodes:
            if arg.op == "get_attr" and arg.name not in local:
                local[arg.name] = f"attr{len(local)}"
                items.append(("get_attr", _value_key(attribute(gm, arg.target))))
        args = map_arg((node.args, node.kwargs), lambda a: local.get(a.name, "?"))
        items.append((node.op, _target_key(gm, node), repr(args), _value_key(node.meta.get("val"))))
        local[name] = f"n{k}"
    items.append(tuple(local[name] for name in layer.outputs))
    return hashlib.sha256(repr(items).encode()).hexdigest()[:16]


def _target_key(gm: fx.GraphModule, node: fx.Node) -> str:
    if node.op == "call_function":
        return _get_qualified_name(node.target) if callable(node.target) else str(node.target)
    if node.op == "call_module":
        module = gm.get_submodule(node.target)
        shapes = [(tuple(p.shape), str(p.dtype)) for p in module.parameters()]
        return f"{type(module).__qualname__}({module.extra_repr()}){shapes}"
    return str(node.target)


def _value_key(value) -> str:
    """Shapes and dtypes of tensors; plain constants (a size, a flag) by value."""
    flat, _ = tree_flatten(value)
    return repr([(tuple(v.shape), str(v.dtype), v.requires_grad) if isinstance(v, torch.Tensor)
                 else v if isinstance(v, int | float | bool | str | None) else type(v).__name__
                 for v in flat])


# ---- measuring one layer -----------------------------------------------------------------------------
@dataclass
class Measurement:
    """What one real run of a layer at one size gives."""

    fwd_s: float
    bwd_s: float
    recompute_s: float
    act_bytes: int
    stash_bytes: int
    workspace_bytes: int | None  # measured on CUDA; None where only an estimate exists
    times: dict[str, list[float]] = field(default_factory=dict)


def measure_layer(module: torch.nn.Module, inputs: Sequence[Any], device: torch.device,
                  repeats: int = REPEATS) -> Measurement:
    """Forward, recompute and backward of one layer (median of `repeats` timed runs after a
    warm-up), the bytes autograd saves (saved_tensors_hooks) and, on CUDA, the transient peak.

    Each timed run is F, then R (the forward again, as a recompute right before a backward), then B.
    """
    _backward(_forward(module, inputs))  # warm-up: lazy initialisation, allocator caches
    _clear_grads(module, inputs)
    state_ids = {_sid(t) for t in (*module.parameters(), *module.buffers())}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if _sid(t) not in state_ids:
            saved[_sid(t)] = t.untyped_storage().nbytes()
        return t

    peak = _PeakMemory(device)
    with peak.phase(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = _forward(module, inputs)
    act = tree_bytes(out[2])
    with peak.phase():
        _backward(out)
    del out
    _clear_grads(module, inputs)

    times: dict[str, list[float]] = {k: [] for k in TIMES}
    for _ in range(repeats):
        seconds, first = _timed(lambda: _forward(module, inputs), device)
        times["fwd_s"].append(seconds)
        del first  # the recompute below must not find the forward's stash still held
        seconds, out = _timed(lambda: _forward(module, inputs), device)
        times["recompute_s"].append(seconds)
        seconds, _ = _timed(functools.partial(_backward, out), device)
        times["bwd_s"].append(seconds if out[0] else 0.0)
        del out
        _clear_grads(module, inputs)
    return Measurement(
        fwd_s=statistics.median(times["fwd_s"]),
        bwd_s=statistics.median(times["bwd_s"]),
        recompute_s=statistics.median(times["recompute_s"]),
        act_bytes=act,
        stash_bytes=sum(saved.values()),
        workspace_bytes=peak.transient if device.type == "cuda" else None,
        times=times,
    )


class _PeakMemory:
    """On CUDA: the largest transient allocation of a phase, above both its start and its end."""

    def __init__(self, device: torch.device):
        self.device, self.transient = device, 0

    @contextlib.contextmanager
    def phase(self):
        if self.device.type != "cuda":
            yield
            return
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        start = torch.cuda.memory_allocated(self.device)
        yield
        torch.cuda.synchronize(self.device)
        top = torch.cuda.max_memory_allocated(self.device)
        end = torch.cuda.memory_allocated(self.device)
        self.transient = max(self.transient, top - max(start, end))


def _forward(module, inputs) -> tuple[list[torch.Tensor], list[torch.Tensor], Any]:
    """Run the layer; return the outputs a backward starts from, a gradient of ones for each,
    and the whole output (kept alive until the backward)."""
    out = module(*inputs)
    flat, _ = tree_flatten(out)
    roots = [t for t in flat if isinstance(t, torch.Tensor) and t.requires_grad and t.is_floating_point()]
    return roots, [torch.ones_like(t) for t in roots], out


def _backward(forward: tuple[list[torch.Tensor], list[torch.Tensor], Any]) -> None:
    roots, grads, _ = forward
    if roots:
        torch.autograd.backward(roots, grads)


def _clear_grads(module, inputs) -> None:
    module.zero_grad(set_to_none=True)
    for t in tree_flatten(list(inputs))[0]:
        if isinstance(t, torch.Tensor):
            t.grad = None


def _timed(fn: Callable[[], Any], device: torch.device) -> tuple[float, Any]:
    _sync(device)
    start = time.perf_counter()
    result = fn()
    _sync(device)
    return time.perf_counter() - start, result


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def real_inputs(values: Sequence[Any], device: torch.device, seed: int = 0) -> list[Any]:
    """Random tensors shaped like the fake values: floats from N(0, 1) (requiring grad where the
    value did), integers in {0, 1} (valid indices and class labels), booleans all True (an
    attention mask that masks nothing). Other values pass through."""
    generator = torch.Generator().manual_seed(seed)

    def make(v):
        if not isinstance(v, torch.Tensor):
            return v
        shape, dtype = tuple(v.shape), v.dtype
        if dtype == torch.bool:
            t = torch.ones(shape, dtype=dtype)
        elif dtype.is_floating_point or dtype.is_complex:
            t = torch.randn(shape, generator=generator).to(dtype)
        else:
            t = torch.randint(0, 2, shape, generator=generator).to(dtype)
        t = t.to(device)
        return t.requires_grad_(v.requires_grad and t.is_floating_point())

    return [tree_map(make, v) for v in values]


# ---- profiling the unique layers ----------------------------------------------------------------------
@dataclass(frozen=True)
class LayerState:
    param: int
    grad: int
    optim: int
    buffers: int


def layer_state_bytes(gm: fx.GraphModule, layer: Layer, optimizer_state_factor: float) -> LayerState:
    """Exact parameter bytes (a tensor used twice in the layer counts once); gradients and
    optimizer state only for trainable ones."""
    params = {id(p): p for p in (gm.get_parameter(name) for name in layer.params)}.values()
    buffers = {id(b): b for b in (attribute(gm, name) for name in layer.buffers)}.values()
    param = sum(_nbytes(p) for p in params)
    grad = sum(_nbytes(p) for p in params if p.requires_grad)
    buffer = sum(_nbytes(b) for b in buffers if isinstance(b, torch.Tensor))
    return LayerState(param, grad, round(optimizer_state_factor * grad), buffer)


def _profile_unique(gm, unique: Sequence[Layer], sizes: Sequence[int], shapes: _ShapeCache,
                    state: Sequence[LayerState], device: Device, repeats: int,
                    quiet: bool) -> dict[int, list[LayerCost]]:
    """Run each unique layer at each probe size; stop a layer's sizes at a real OOM."""
    where = device.torch_device
    console = Console(stderr=True)
    columns = (TextColumn("profiling {task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    out: dict[int, list[LayerCost]] = {}
    cuda = [torch.cuda.current_device() if where.index is None else where.index] if where.type == "cuda" else []
    show = not quiet and console.is_terminal
    # fork_rng: a layer with dropout must not move the user's random stream
    with torch.random.fork_rng(devices=cuda), Progress(*columns, console=console, transient=True,
                                                        disable=not show) as bar:
        task = bar.add_task("layers", total=len(unique) * len(sizes))
        for layer in unique:
            bar.update(task, description=layer.name)
            module = layer_module(gm, layer).to(where)
            out[layer.index] = []
            for u in sizes:
                at_u = shapes.at(u)
                own = module if at_u.graph is None else layer_module(at_u.graph, layer).to(where)
                cost = _probe(own, layer, u, at_u, state[layer.index], where, repeats)
                bar.advance(task)
                if cost is None:
                    break
                out[layer.index].append(cost)
            if not out[layer.index]:
                raise ProfileError(
                    f"layer {layer.name!r} runs out of memory on {device.name!r} even at microbatch "
                    f"size {sizes[0]}: give it more memory or split the module into smaller ones"
                )
            del module
    return out


def _probe(module, layer: Layer, u: int, shapes: _Shapes, state: LayerState, device: torch.device,
           repeats: int) -> LayerCost | None:
    inputs = real_inputs([shapes.values[name] for name in layer.inputs], device, seed=layer.index)
    try:
        m = measure_layer(module, inputs, device, repeats)
    except torch.OutOfMemoryError:
        torch.cuda.empty_cache()
        return None
    except Exception as err:  # noqa: BLE001 - any failure on synthetic inputs is reported the same way
        raise ProfileError(
            f"layer {layer.name!r} failed on synthetic inputs at microbatch size {u} "
            f"({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}); "
            f"use cost='analytic' for this model"
        ) from err
    workspace = m.workspace_bytes if m.workspace_bytes is not None else shapes.largest_bytes[layer.index]
    return LayerCost(
        layer=layer.index, u=u, fwd_s=m.fwd_s, bwd_s=m.bwd_s, recompute_s=m.recompute_s,
        param_bytes=state.param, grad_bytes=state.grad, optim_bytes=state.optim,
        act_bytes=m.act_bytes, stash_bytes=m.stash_bytes, workspace_bytes=int(workspace),
    )


# ---- cache ------------------------------------------------------------------------------------------------
STALE_RATIO = 2.0  # a cached layer this much slower than a fresh measurement was timed under load
SPOT_CHECK_REPEATS = 5


def _measured_under_load(cached: Sequence[LayerProfile], gm: fx.GraphModule, layers: Sequence[Layer], traced: int,
                         device: Device) -> bool:
    """A profile taken while other jobs loaded the machine keeps its inflated times in the cache
    for good. Re-time the costliest layer at the traced size (a fraction of a second); if the
    cache says it is STALE_RATIO times slower than it runs now, the cache is not trusted."""
    _, costliest = max(((p.fwd_s(traced) + p.bwd_s(traced), p) for p in cached), key=lambda pair: pair[0])
    layer = layers[costliest.layer]
    where = device.torch_device
    inputs = real_inputs([shapes_at(gm, layers, traced, traced).values[name] for name in layer.inputs], where,
                         seed=layer.index)
    with torch.random.fork_rng(devices=[where.index or 0] if where.type == "cuda" else []):
        fresh = measure_layer(layer_module(gm, layer).to(where), inputs, where, repeats=SPOT_CHECK_REPEATS)
    alone = costliest.fwd_s(traced) / costliest.context_fwd + costliest.bwd_s(traced) / costliest.context_bwd
    return alone > STALE_RATIO * (fresh.fwd_s + fresh.bwd_s)


# ---- layers in context -----------------------------------------------------------------------------------
def in_context_factors(gm: fx.GraphModule, layers: Sequence[Layer], profiles: Sequence[LayerProfile],
                       shapes: _Shapes, device: Device, repeats: int = CONTEXT_REPEATS) -> list[tuple[float, float]]:
    """Per layer, how much slower its forward and its backward run back to back with the other
    layers than on their own: (forward factor, backward factor).

    A probe repeats one layer on the same inputs, so its weights and activations stay in cache;
    in a stage each layer meets the previous one's output and its own weights cold. PipeDream
    (dissertation §2.4.1) times layers inside whole training iterations for this reason. Here
    every layer runs in model order at the traced size on its predecessors' real outputs, each
    forward timed, then every backward in reverse order, each fed the gradients its consumers
    produced (median of `repeats` passes after a warm-up; of at least CONTEXT_MIN_REPEATS once the
    passes took CONTEXT_BUDGET_S). Identical layers share the median of their factors. Measured only where the model already lives on `device` (no copy of a model
    that may not fit); (1, 1) elsewhere, on OOM, and for a factor outside CONTEXT_RANGE.
    """
    where = device.torch_device
    neutral = [(1.0, 1.0)] * len(layers)
    if any(t.device.type != where.type for t in (*gm.parameters(), *gm.buffers())):
        return neutral
    modules = [layer_module(gm, layer).to(where) for layer in layers]
    placeholders = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    inputs = dict(zip(placeholders, real_inputs([shapes.values[name] for name in placeholders], where), strict=True))
    outputs = {n.name for n in gm.graph.output_node().all_input_nodes}
    times = [([], []) for _ in layers]
    cuda = [where.index or 0] if where.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=cuda):
            _layers_back_to_back(layers, modules, inputs, outputs, where)  # warm-up
            began = time.perf_counter()
            for run in range(repeats):
                if run >= CONTEXT_MIN_REPEATS and time.perf_counter() - began > CONTEXT_BUDGET_S:
                    break
                for (fwd, bwd), seconds in zip(times, _layers_back_to_back(layers, modules, inputs, outputs, where),
                                               strict=True):
                    fwd.append(seconds[0])
                    bwd.append(seconds[1])
    except torch.OutOfMemoryError:
        torch.cuda.empty_cache()
        return neutral
    traced = shapes.u
    ratios = [(_ratio(statistics.median(fwd), p.fwd_s(traced)), _ratio(statistics.median(bwd), p.bwd_s(traced)))
              for (fwd, bwd), p in zip(times, profiles, strict=True)]
    by_signature: dict[str, list[tuple[float, float]]] = {}
    for p, ratio in zip(profiles, ratios, strict=True):
        by_signature.setdefault(p.signature, []).append(ratio)
    return [tuple(statistics.median(r[k] for r in by_signature[p.signature]) for k in (0, 1)) for p in profiles]


def _ratio(in_context: float, alone: float) -> float:
    factor = in_context / alone if alone > 0 else 1.0
    return factor if CONTEXT_RANGE[0] <= factor <= CONTEXT_RANGE[1] else 1.0


def _layers_back_to_back(layers: Sequence[Layer], modules: Sequence[fx.GraphModule], inputs: dict[str, Any],
                         outputs: set[str], where: torch.device) -> list[tuple[float, float]]:
    """One pass: each layer's forward in order, then each backward in reverse; (fwd s, bwd s) per layer.
    A layer's floating inputs are leaves of their own, so its backward stops at its boundary and
    their gradients are what its producers' backwards receive."""
    values = dict(inputs)
    leaves: list[list[tuple[str, torch.Tensor]]] = []
    results: list[tuple] = []
    forward_s = []
    for layer, module in zip(layers, modules, strict=True):
        args, mine = [], []
        for name in layer.inputs:
            value = values[name]
            if isinstance(value, torch.Tensor) and value.is_floating_point() and value.requires_grad:
                value = value.detach().requires_grad_()
                mine.append((name, value))
            args.append(value)
        seconds, result = _timed(lambda module=module, args=args: module(*args), where)
        forward_s.append(seconds)
        values.update(zip(layer.outputs, result, strict=True))
        leaves.append(mine)
        results.append(result)
    grads = {name: torch.ones_like(values[name]) for name in outputs
             if isinstance(values.get(name), torch.Tensor) and values[name].requires_grad}
    backward_s = [0.0] * len(layers)
    for i in reversed(range(len(layers))):
        roots = [(t, grads.pop(name)) for name, t in zip(layers[i].outputs, results[i], strict=True)
                 if name in grads and isinstance(t, torch.Tensor) and t.requires_grad]
        if roots:
            tensors, seeds = zip(*roots, strict=True)
            backward_s[i], _ = _timed(functools.partial(torch.autograd.backward, list(tensors), list(seeds)), where)
        for name, leaf in leaves[i]:
            if leaf.grad is not None:
                grads[name] = grads[name] + leaf.grad if name in grads else leaf.grad
        modules[i].zero_grad(set_to_none=True)
    return list(zip(forward_s, backward_s, strict=True))


def cache_dir() -> Path:
    """$STAGEWISE_CACHE/profiles, default ~/.cache/stagewise/profiles."""
    root = os.environ.get("STAGEWISE_CACHE") or Path.home() / ".cache" / "stagewise"
    return Path(root) / "profiles"


def cache_key(gm: fx.GraphModule, layers: Sequence[Layer], signatures: Sequence[str], device: Device,
              request: dict) -> str:
    """The graph's structure (its code, every value's shape, the layering), the device's name and
    kind, the torch version and what was asked for."""
    shapes = [(n.name, _value_key(n.meta.get("val"))) for n in gm.graph.nodes]
    parts = [CACHE_VERSION, gm.code, shapes, [(lr.nodes, lr.params) for lr in layers], list(signatures),
             device.name, device.torch_device.type, _device_model(device), torch.__version__,
             sorted(request.items())]
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:24]


def _device_model(device: Device) -> str:
    where = device.torch_device
    return torch.cuda.get_device_name(where) if where.type == "cuda" else "cpu"


def _load(key: str) -> list[LayerProfile] | None:
    path = cache_dir() / f"{key}.json"
    try:
        data = json.loads(path.read_text())
        return [LayerProfile.from_dict(p) for p in data["profiles"]]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _save(key: str, profiles: Sequence[LayerProfile]) -> None:
    """Write atomically; a cache that cannot be written is not an error."""
    path = cache_dir() / f"{key}.json"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"version": CACHE_VERSION, "profiles": [p.to_dict() for p in profiles]}))
        os.replace(tmp, path)
    except OSError:
        pass


# ---- small helpers ---------------------------------------------------------------------------------------
def tree_bytes(value) -> int:
    """Bytes of the tensors in a value (a tensor, or tuples / lists / dicts of them)."""
    flat, _ = tree_flatten(value)
    return sum(_nbytes(t) for t in flat if isinstance(t, torch.Tensor))


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _sid(t: torch.Tensor) -> int:
    """Identity of a tensor's storage: views of one tensor share it."""
    return t.untyped_storage()._cdata


def _state_tensors(gm: fx.GraphModule) -> list[torch.Tensor]:
    tensors = [*gm.parameters(), *gm.buffers()]
    tensors += [v for n in gm.graph.nodes if n.op == "get_attr"
                for v in [attribute(gm, n.target)] if isinstance(v, torch.Tensor)]
    return tensors

