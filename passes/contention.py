"""How fast CPU devices of one process compute when several compute at once.

The profiler times each layer alone, but in-process CPU devices are threads that share the
host's cores, its memory bandwidth and the GIL (every op's Python dispatch holds it). Two
devices computing at once on this 2-core machine each run at about half their speed alone for
small, Python-heavy layers, and closer to full speed for large matmuls. The simulator needs
that curve to predict a step (Srifty §3.3 calibrates its simulator on the real cluster for
the same reason), so it is measured on the model's own costliest layer kind: k threads, each
with its own copy of the layer, run its forward and backward at the same moment, for
k = 1 .. the number of devices.
"""

from __future__ import annotations

import copy
import statistics
import threading
import time
from collections import defaultdict
from collections.abc import Sequence

import torch
import torch.fx as fx
from stagewise.compiler.ir import Layer, LayerCost
from stagewise.passes.profile import layer_module, layer_signature, real_inputs, shapes_at
from torch.utils._pytree import tree_flatten

REPEATS = 4


def costliest_layer(gm: fx.GraphModule, layers: Sequence[Layer], costs: Sequence[LayerCost]) -> Layer:
    """The layer whose kind (identical structure and shapes) takes the largest share of a step."""
    share: dict[str, float] = defaultdict(float)
    first: dict[str, Layer] = {}
    for layer, cost in zip(layers, costs, strict=True):
        signature = layer_signature(gm, layer)
        share[signature] += cost.fwd_s + cost.bwd_s
        first.setdefault(signature, layer)
    return first[max(share, key=share.get)]


def concurrent_speeds(gm: fx.GraphModule, layers: Sequence[Layer], costs: Sequence[LayerCost], traced_microbatch: int,
                      threads: int) -> tuple[float, ...]:
    """Speed of each of k computing threads relative to one alone, for k = 1 .. threads (non-increasing),
    at the microbatch size the graph was traced at."""
    layer = costliest_layer(gm, layers, costs)
    shapes = shapes_at(gm, layers, traced_microbatch, traced_microbatch)
    module = layer_module(gm, layer)
    copies = [copy.deepcopy(module) for _ in range(threads)]
    inputs = [real_inputs([shapes.values[name] for name in layer.inputs], torch.device("cpu"), seed=i)
              for i in range(threads)]
    alone = statistics.median(_run_together(copies[:1], inputs[:1]))
    speeds = [1.0]
    for k in range(2, threads + 1):
        together = statistics.median(_run_together(copies[:k], inputs[:k]))
        speeds.append(min(speeds[-1], alone / together))
    return tuple(speeds)


def _run_together(modules: list[torch.nn.Module], inputs: list[list]) -> list[float]:
    """Each module's forward + backward, REPEATS times, all threads starting each repeat together."""
    start = threading.Barrier(len(modules))
    times: list[float] = []
    lock = threading.Lock()

    def work(module: torch.nn.Module, args: list) -> None:
        _step(module, args)  # warm-up
        for _ in range(REPEATS):
            start.wait()
            began = time.perf_counter()
            _step(module, args)
            with lock:
                times.append(time.perf_counter() - began)

    workers = [threading.Thread(target=work, args=pair, daemon=True) for pair in zip(modules, inputs, strict=True)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    return times


def _step(module: torch.nn.Module, args: list) -> None:
    outputs, _ = tree_flatten(module(*args))
    roots = [t for t in outputs if isinstance(t, torch.Tensor) and t.requires_grad and t.is_floating_point()]
    if roots:
        torch.autograd.backward(roots, [torch.ones_like(t) for t in roots])
    module.zero_grad(set_to_none=True)
    for t in tree_flatten(args)[0]:
        if isinstance(t, torch.Tensor):
            t.grad = None
