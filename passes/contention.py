"""How fast CPU devices of one process compute when several compute at once.

The profiler times each layer alone, but in-process CPU devices are threads that share the
host's cores, its memory bandwidth and the GIL (every op's Python dispatch holds it). Two
devices computing at once on this 2-core machine each run at about half their speed alone for
small, Python-heavy layers, and closer to full speed for large matmuls. The simulator needs
that curve to predict a step (Srifty §3.3 calibrates its simulator on the real cluster for
the same reason), so it is measured on the model's own costliest layer kind: k threads, each
with its own copy of the layer, loop over its forward and backward at the same time for a
window of several steps, for k = 1 .. the number of devices; the rate per thread over the rate
alone is the speed, capped at cores / k (more threads than cores cannot all run). Each rate is the
highest of SPEED_REPEATS interleaved windows (the least disturbed by other work on the machine),
and the figures are kept per machine (passes/machine_cache.py): measured once, read by every
later process.
"""

from __future__ import annotations

import copy
import functools
import os
import statistics
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch.utils._pytree import tree_flatten

from stagewise.ir.plan import Layer, LayerCost
from stagewise.passes.machine_cache import remembered
from stagewise.passes.profile_layer import layer_module, layer_signature
from stagewise.passes.profile_measure import least_disturbed, real_inputs
from stagewise.passes.profile_shapes import shapes_at

MIN_WINDOW_S = 0.03  # each measurement keeps every thread busy at least this long
WINDOW_STEPS = 6  # ... and for at least this many steps of one thread alone
WAKE_GAP_S = 0.01  # an idle wait like a pipeline's for its next input
WAKE_REPEATS = 7
SPEED_REPEATS = 3  # windows per thread count, interleaved: alone, 2, ..., alone, 2, ...
OptimizerFactory = Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]  # the user's, over some parameters


def available_cores() -> int:
    """The cores this process may run on (its CPU affinity, not the machine's count)."""
    return len(os.sched_getaffinity(0))


def computes_at_full_speed() -> float:
    """How many single-device computes this process's cores run at full speed at once: the cores it
    may use over each compute's intra-op threads."""
    return available_cores() / min(torch.get_num_threads(), os.cpu_count() or 1)


def costliest_layer(gm: fx.GraphModule, layers: Sequence[Layer], costs: Sequence[LayerCost]) -> Layer:
    """The layer whose kind (identical structure and shapes) takes the largest share of a step."""
    share: dict[str, float] = defaultdict(float)
    first: dict[str, Layer] = {}
    for layer, cost in zip(layers, costs, strict=True):
        signature = layer_signature(gm, layer)
        share[signature] += cost.fwd_s + cost.bwd_s
        first.setdefault(signature, layer)
    return first[max(share, key=share.__getitem__)]


@dataclass(frozen=True)
class HostContention:
    """`speeds[k - 1]`: each of k computing threads' speed relative to one alone; `wake_s`: what a
    compute costs beyond its profile when its thread was idle just before (a thread that waited for
    its input finds its core clocked down and its caches cold; the profiler times layers back to back)."""

    speeds: tuple[float, ...]
    wake_s: float
    update_speeds: tuple[float, ...] = ()  # the same for the user's optimizer step (GIL-bound on a CPU)


def host_contention(gm: fx.GraphModule, layers: Sequence[Layer], costs: Sequence[LayerCost], traced_microbatch: int,
                    threads: int, optimizer_factory: OptimizerFactory | None = None) -> HostContention:
    """Measured on the costliest layer kind at the traced microbatch size: speeds for k = 1 .. threads
    (non-increasing, never above cores / k), the wake-up cost, and with `optimizer_factory` the speeds
    of k threads stepping it over the layer's parameters. Measured once per machine for a layer
    kind, size and optimizer, so plans compiled side by side, or in later processes, are charged alike."""
    layer = costliest_layer(gm, layers, costs)
    # the factory by its repr: equal partials (a new one per compile) are the same optimizer
    key = (layer_signature(gm, layer), traced_microbatch, threads, repr(optimizer_factory))
    measure = functools.partial(_measure, gm, layers, layer, traced_microbatch, threads, optimizer_factory)
    return remembered("contention", key, measure, HostContention)


def _measure(gm: fx.GraphModule, layers: Sequence[Layer], layer: Layer, traced_microbatch: int,
             threads: int, optimizer_factory: OptimizerFactory | None) -> HostContention:
    shapes = shapes_at(gm, layers, traced_microbatch, traced_microbatch)
    module = layer_module(gm, layer)
    copies = [copy.deepcopy(module) for _ in range(threads)]
    inputs = [real_inputs([shapes.values[name] for name in layer.inputs], torch.device("cpu"), seed=i)
              for i in range(threads)]
    steps: list[Callable[[], None]] = [functools.partial(_step, module, args)
                                       for module, args in zip(copies, inputs, strict=True)]
    speeds, warm_s = _speeds(steps)
    updates = [_update_step(module, optimizer_factory) for module in copies] if optimizer_factory else []
    steppable = [update for update in updates if update is not None]  # a copy without parameters has no step
    update_speeds = _speeds(steppable)[0] if steppable and len(steppable) == len(updates) else ()
    return HostContention(speeds, _wake_seconds(copies[0], inputs[0], warm_s), update_speeds)


def _speeds(steps: list[Callable[[], None]]) -> tuple[tuple[float, ...], float]:
    """Each of k threads' speed relative to one alone, for k = 1 .. len(steps) (non-increasing, never
    above cores / k), and the seconds of one step alone, back to back."""
    window = max(MIN_WINDOW_S, WINDOW_STEPS / _rate(steps[:1], MIN_WINDOW_S))
    rates: list[list[float]] = [[] for _ in steps]  # per thread count k - 1
    for _ in range(SPEED_REPEATS):
        for k, measured in enumerate(rates, start=1):
            measured.append(_rate(steps[:k], window))
    best = [max(measured) for measured in rates]
    cores = computes_at_full_speed()
    speeds = [1.0]
    for k in range(2, len(steps) + 1):
        speeds.append(min(speeds[-1], cores / k, best[k - 1] / best[0]))
    return tuple(speeds), 1 / best[0]


def _update_step(module: torch.nn.Module, optimizer_factory: OptimizerFactory) -> Callable[[], None] | None:
    """One optimizer step over the layer copy's parameters (gradients set once), or None without any."""
    params = [p for p in module.parameters() if p.requires_grad]
    if not params:
        return None
    for param in params:
        param.grad = torch.full_like(param, 1e-3)
    return optimizer_factory(params).step


def _wake_seconds(module: torch.nn.Module, args: list, warm_s: float) -> float:
    """Extra seconds of a forward + backward right after the thread slept WAKE_GAP_S (the least disturbed
    of WAKE_REPEATS) over a step in a back-to-back loop (`warm_s`, the condition the profiler times
    layers in)."""
    times = []
    for _ in range(WAKE_REPEATS):
        time.sleep(WAKE_GAP_S)
        began = time.perf_counter()
        _step(module, args)
        times.append(time.perf_counter() - began)
    return max(least_disturbed(times) - warm_s, 0.0)


def _rate(steps: list[Callable[[], None]], window: float) -> float:
    """Steps per second of each thread while len(steps) threads, one per step function, loop for
    `window` seconds at once (a rate over whole steps: the last one may end after the window)."""
    start = threading.Barrier(len(steps))
    rates: list[float] = []
    lock = threading.Lock()

    def work(step: Callable[[], None]) -> None:
        step()  # warm-up
        start.wait()
        began = time.perf_counter()
        count, now = 0, began
        while now - began < window:
            step()
            count, now = count + 1, time.perf_counter()
        with lock:
            rates.append(count / (now - began))

    workers = [threading.Thread(target=work, args=(step,), daemon=True) for step in steps]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    return statistics.mean(rates)


def _step(module: torch.nn.Module, args: list) -> None:
    outputs, _ = tree_flatten(module(*args))
    roots = [t for t in outputs if isinstance(t, torch.Tensor) and t.requires_grad and t.is_floating_point()]
    if roots:
        torch.autograd.backward(roots, [torch.ones_like(t) for t in roots])
    module.zero_grad(set_to_none=True)
    for t in tree_flatten(args)[0]:
        if isinstance(t, torch.Tensor):
            t.grad = None
