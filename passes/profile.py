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

Load. Other work on the machine only ever makes a run slower, so each time is the least disturbed
(the minimum) of its repeats, and the repeats are rounds over all the layers rather than back to
back: a load that lasts part of the profile leaves each layer quiet rounds.

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

This module decides what is measured, when and on which layers. The parts live beside it:
profile_fit (the piecewise-linear fits), profile_shapes (fake-tensor shapes and bytes),
profile_layer (a layer's module, signature and state), profile_sizes (slow start, probe sizes),
profile_measure (timing one layer), profile_context (timing layers in context), profile_cache.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import replace

import torch
import torch.fx as fx
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from stagewise.ir.devices import Device, parse_bytes, resolve_devices
from stagewise.ir.errors import ProfileError
from stagewise.ir.plan import Layer, LayerCost
from stagewise.passes.profile_cache import cache_key, load, save
from stagewise.passes.profile_context import CONTEXT_REPEATS, in_context_factors
from stagewise.passes.profile_fit import LayerProfile, PiecewiseLinear, costs_at
from stagewise.passes.profile_layer import (
    OPTIMIZER_STATE_FACTOR,
    LayerState,
    layer_module,
    layer_signature,
    layer_state_bytes,
)
from stagewise.passes.profile_measure import (
    REPEATS,
    at_precision,
    least_disturbed,
    measure_layer,
    real_inputs,
    retime_layer,
)
from stagewise.passes.profile_shapes import ShapeCache, Shapes, shapes_at
from stagewise.passes.profile_sizes import MAX_MICROBATCH, does_not_fit, fits, probe_list, slow_start

__all__ = ["LayerProfile", "PiecewiseLinear", "ProfileError", "costs_at", "profile_layers", "traced_microbatch_size"]

STALE_RATIO = 2.0  # a cached layer this much slower than a fresh measurement was timed under load
SPOT_CHECK_REPEATS = 5


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
    precision: str = "fp32",
    compiled: bool = False,
) -> list[LayerProfile]:
    """Profile every layer of `gm` on `device` (Harmony §4.2) and fit costs in u (Srifty §3).

    capacity (default: the device's `memory`) bounds the microbatch: the slow-start search
    finds the largest u whose every layer fits, and the default probes spread over 1..that u.
    Without a capacity the default probes spread over 1..traced microbatch size.
    `microbatch_sizes` picks the probes instead (those that do not fit are dropped).
    `graph_at(u)`: the graph at microbatch size u, for graphs that run at their traced size only
    (torch.export's): each probe size is then measured on a graph of its own.
    `precision`: forwards are timed and shapes propagated under its autocast (ir/precision.py), so
    times, stash and workspace bytes are those of training at that precision; state stays fp32.
    `compiled` (compile_stages): the probes run eagerly, and the in-context pass runs each layer through
    torch.compile, so every time is scaled to the compiled layer's at the traced size (bytes stay eager's).
    """
    device = resolve_devices(device)[0]
    capacity_bytes = parse_bytes(capacity if capacity is not None else device.memory)
    traced = traced_microbatch or traced_microbatch_size(gm)
    signatures = [layer_signature(gm, layer) for layer in layers]
    request = dict(sizes=list(microbatch_sizes or ()), capacity=capacity_bytes, traced=traced, repeats=repeats,
                   optim=optimizer_state_factor, limit=max_microbatch, precision=precision,
                   **({"compiled": True} if compiled else {}))  # eager profiles keep their keys
    key = cache_key(gm, layers, signatures, device, request)
    if cache and (hit := load(key)) is not None and not _measured_under_load(hit, gm, layers, traced, device, precision):
        return hit

    shapes = ShapeCache(gm, layers, traced, graph_at, precision)
    state = [layer_state_bytes(gm, layer, optimizer_state_factor) for layer in layers]
    largest = _largest_fitting(shapes, state, layers, capacity_bytes, device, max_microbatch)
    sizes = probe_list(microbatch_sizes, largest or traced, largest, shapes)

    first_of = _first_of_each_signature(layers, signatures)
    unique = [layers[i] for i in first_of.values()]
    measured = _profile_unique(gm, unique, sizes, shapes, state, device, repeats, quiet, precision)
    measured_top = min(max(p.u for p in probes) for probes in measured.values())
    if measured_top < max(sizes):  # a real OOM cut some layer's probes short
        largest = measured_top

    by_sig = {
        signatures[i]: LayerProfile.from_probes(layers[i], signatures[i], measured[i], largest)
        for i in first_of.values()
    }
    profiles = [by_sig[sig].for_layer(layer) for layer, sig in zip(layers, signatures, strict=True)]
    factors = in_context_factors(gm, layers, profiles, shapes.at(traced), device, max(repeats, CONTEXT_REPEATS),
                                 precision, compiled)
    profiles = [p.in_context(*f) for p, f in zip(profiles, factors, strict=True)]
    if cache:
        save(key, profiles)
    return profiles


def traced_microbatch_size(gm: fx.GraphModule) -> int:
    """The batch (dim 0) of the first tensor graph input: the size the graph was traced at."""
    for node in gm.graph.nodes:
        value = node.meta.get("val")
        if node.op == "placeholder" and isinstance(value, torch.Tensor) and value.dim() > 0:
            return int(value.shape[0])
    raise ProfileError("the traced graph has no tensor input with a batch dimension to vary")


def _first_of_each_signature(layers: Sequence[Layer], signatures: Sequence[str]) -> dict[str, int]:
    """Per signature, the first layer that has it: identical layers are measured once."""
    first_of: dict[str, int] = {}
    for layer, sig in zip(layers, signatures, strict=True):
        first_of.setdefault(sig, layer.index)
    return first_of


def _largest_fitting(shapes: ShapeCache, state: Sequence[LayerState], layers: Sequence[Layer],
                     capacity: int | None, device: Device, limit: int) -> int | None:
    """The largest microbatch size at which every layer fits `capacity` (None: no capacity given)."""
    if capacity is None:
        return None
    largest = slow_start(lambda u: fits(shapes.at(u), state, capacity), limit)
    if largest == 0:
        raise does_not_fit(shapes.at(1), state, layers, capacity, device)
    return largest


# ---- profiling the unique layers ----------------------------------------------------------------------
def _profile_unique(gm, unique: Sequence[Layer], sizes: Sequence[int], shapes: ShapeCache,
                    state: Sequence[LayerState], device: Device, repeats: int,
                    quiet: bool, precision: str) -> dict[int, list[LayerCost]]:
    """Run each unique layer at each probe size; stop a layer's sizes at a real OOM. The repeats are
    `repeats` rounds over all the layers, not back to back: a load that lasts part of the profile
    disturbs some rounds of a layer, and each time is its least disturbed round."""
    where = device.torch_device
    console = Console(stderr=True)
    columns = (TextColumn("profiling {task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    out: dict[int, list[LayerCost]] = {}
    cuda = [torch.cuda.current_device() if where.index is None else where.index] if where.type == "cuda" else []
    show = not quiet and console.is_terminal
    # fork_rng: a layer with dropout must not move the user's random stream
    with torch.random.fork_rng(devices=cuda), Progress(*columns, console=console, transient=True,
                                                        disable=not show) as bar:
        task = bar.add_task("layers", total=len(unique) * len(sizes) * repeats)
        for round_ in range(repeats):
            for layer in unique:
                bar.update(task, description=layer.name)
                if round_ == 0:
                    out[layer.index] = _probe_sizes(gm, layer, sizes, shapes, state[layer.index], where, precision,
                                                    functools.partial(bar.advance, task))
                else:
                    out[layer.index] = _retimed(gm, layer, out[layer.index], shapes, where, precision)
                    bar.advance(task, len(sizes))
                if not out[layer.index]:
                    raise ProfileError(
                        f"layer {layer.name!r} runs out of memory on {device.name!r} even at microbatch "
                        f"size {sizes[0]}: give it more memory or split the module into smaller ones"
                    )
    return out


def _probe_sizes(gm: fx.GraphModule, layer: Layer, sizes: Sequence[int], shapes: ShapeCache, state: LayerState,
                 where: torch.device, precision: str, advance: Callable[[], object]) -> list[LayerCost]:
    """The first round: one timed run of the layer at each size, and its bytes, up to the first
    size that runs out of memory."""
    module = layer_module(gm, layer).to(where)
    costs: list[LayerCost] = []
    for u in sizes:
        at_u = shapes.at(u)
        own = module if at_u.graph is None else layer_module(at_u.graph, layer).to(where)
        cost = _probe(own, layer, u, at_u, state, where, precision)
        advance()
        if cost is None:
            break
        costs.append(cost)
    return costs


def _retimed(gm: fx.GraphModule, layer: Layer, probes: Sequence[LayerCost], shapes: ShapeCache,
             where: torch.device, precision: str) -> list[LayerCost]:
    """A later round: each probe's times again, the least disturbed of the two kept."""
    module = layer_module(gm, layer).to(where)
    kept = []
    for probe in probes:
        at_u = shapes.at(probe.u)
        own = module if at_u.graph is None else layer_module(at_u.graph, layer).to(where)
        inputs = real_inputs([at_u.values[name] for name in layer.inputs], where, seed=layer.index)
        try:
            times = retime_layer(at_precision(own, precision, where), inputs, where)
        except torch.OutOfMemoryError:  # it fitted in the first round: keep that round's figures
            torch.cuda.empty_cache()
            times = {}
        kept.append(replace(probe, fwd_s=least_disturbed([probe.fwd_s, *times.get("fwd_s", ())]),
                            bwd_s=least_disturbed([probe.bwd_s, *times.get("bwd_s", ())]),
                            recompute_s=least_disturbed([probe.recompute_s, *times.get("recompute_s", ())])))
    return kept


def _probe(module, layer: Layer, u: int, shapes: Shapes, state: LayerState, device: torch.device,
           precision: str) -> LayerCost | None:
    inputs = real_inputs([shapes.values[name] for name in layer.inputs], device, seed=layer.index)
    try:
        m = measure_layer(at_precision(module, precision, device), inputs, device, repeats=1)
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


# ---- trusting the cache ---------------------------------------------------------------------------------
def _measured_under_load(cached: Sequence[LayerProfile], gm: fx.GraphModule, layers: Sequence[Layer], traced: int,
                         device: Device, precision: str) -> bool:
    """A profile taken while other jobs loaded the machine keeps its inflated times in the cache
    for good. Re-time the costliest layer at the traced size (a fraction of a second); if the
    cache says it is STALE_RATIO times slower than it runs now, the cache is not trusted."""
    _, costliest = max(((p.fwd_s(traced) + p.bwd_s(traced), p) for p in cached), key=lambda pair: pair[0])
    layer = layers[costliest.layer]
    where = device.torch_device
    values = shapes_at(gm, layers, traced, traced, precision).values  # the whole graph run once, on fake tensors
    inputs = real_inputs([values[name] for name in layer.inputs], where, seed=layer.index)
    with torch.random.fork_rng(devices=[where.index or 0] if where.type == "cuda" else []):
        fresh = measure_layer(at_precision(layer_module(gm, layer).to(where), precision, where), inputs, where,
                              repeats=SPOT_CHECK_REPEATS)
    alone = costliest.fwd_s(traced) / costliest.context_fwd + costliest.bwd_s(traced) / costliest.context_bwd
    return alone > STALE_RATIO * (fresh.fwd_s + fresh.bwd_s)
