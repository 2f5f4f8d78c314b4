"""Measuring one layer for real: its forward, recompute and backward times and the bytes it holds.

The workspace is measured on CUDA (the peak allocation of a forward or backward above both
its start and its end); elsewhere the caller estimates it from fake shapes. Inputs are
synthetic (normal floats, integers in {0, 1}, all-True masks): a layer whose speed depends on
the values (sparse routing) is timed on typical-looking data only. Each time is the least disturbed
of its repeats: other work on the machine only ever makes a run slower.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map

from stagewise.ir.precision import autocast_for
from stagewise.passes.profile_fit import TIMES
from stagewise.passes.profile_shapes import storage_id, tree_bytes

REPEATS = 3


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
    """Forward, recompute and backward of one layer (the least disturbed of `repeats` timed runs
    after a warm-up), the bytes autograd saves (saved_tensors_hooks) and, on CUDA, the transient peak.

    Each timed run is F, then R (the forward again, as a recompute right before a backward), then B.
    """
    _backward(_forward(module, _own_copies(inputs)))  # warm-up: lazy initialisation, allocator caches
    _clear_grads(module, inputs)
    state_ids = {storage_id(t) for t in (*module.parameters(), *module.buffers())}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if storage_id(t) not in state_ids:
            saved[storage_id(t)] = t.untyped_storage().nbytes()
        return t

    peak = _PeakMemory(device)
    args = _own_copies(inputs)
    with peak.phase(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = _forward(module, args)
    act = tree_bytes(out[2])
    with peak.phase():
        _backward(out)
    del out
    _clear_grads(module, inputs)

    times = _timed_runs(module, inputs, device, repeats)
    return Measurement(
        fwd_s=least_disturbed(times["fwd_s"]),
        bwd_s=least_disturbed(times["bwd_s"]),
        recompute_s=least_disturbed(times["recompute_s"]),
        act_bytes=act,
        stash_bytes=sum(saved.values()),
        workspace_bytes=peak.transient if device.type == "cuda" else None,
        times=times,
    )


def retime_layer(module: torch.nn.Module, inputs: Sequence[Any], device: torch.device) -> dict[str, list[float]]:
    """One more timed run of forward, recompute and backward after a warm-up (a later round of
    the profile: the bytes are those of the first)."""
    _backward(_forward(module, _own_copies(inputs)))
    _clear_grads(module, inputs)
    return _timed_runs(module, inputs, device, 1)


def _timed_runs(module: torch.nn.Module, inputs: Sequence[Any], device: torch.device,
                repeats: int) -> dict[str, list[float]]:
    """Seconds of `repeats` runs of F, then R (the forward again, as a recompute right before a
    backward), then B, per quantity."""
    times: dict[str, list[float]] = {k: [] for k in TIMES}
    for _ in range(repeats):
        seconds, first = timed(functools.partial(_forward, module, _own_copies(inputs)), device)
        times["fwd_s"].append(seconds)
        del first  # the recompute below must not find the forward's stash still held
        seconds, out = timed(functools.partial(_forward, module, _own_copies(inputs)), device)
        times["recompute_s"].append(seconds)
        seconds, _ = timed(functools.partial(_backward, out), device)
        times["bwd_s"].append(seconds if out[0] else 0.0)
        del out
        _clear_grads(module, inputs)
    return times


class Autocast(torch.nn.Module):
    """A layer whose forward runs under the precision's autocast and whose backward runs outside
    it, as the runtime runs a stage (runtime/handlers.py), so a measurement is the precision's."""

    def __init__(self, layer: torch.nn.Module, precision: str, device: torch.device):
        super().__init__()
        self.layer, self.precision, self.device = layer, precision, device

    def forward(self, *args):
        with autocast_for(self.precision, self.device):
            return self.layer(*args)


def at_precision(layer: torch.nn.Module, precision: str, device: torch.device) -> torch.nn.Module:
    """`layer` as measured at `precision`: itself in fp32."""
    return layer if precision == "fp32" else Autocast(layer, precision, device)


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


def _own_copies(inputs: Sequence[Any]) -> list[Any]:
    """Copies of the inputs for one run, made before its timer starts: a layer that modifies its
    input in place (one left in place by the capture) may, and a copy is not a leaf, so autograd
    lets it; gradients still reach the inputs through the copy."""
    return [tree_map(lambda v: v.clone() if isinstance(v, torch.Tensor) else v, value) for value in inputs]


def _backward(forward: tuple[list[torch.Tensor], list[torch.Tensor], Any]) -> None:
    roots, grads, _ = forward
    if roots:
        torch.autograd.backward(roots, grads)


def _clear_grads(module, inputs) -> None:
    module.zero_grad(set_to_none=True)
    for t in tree_flatten(list(inputs))[0]:
        if isinstance(t, torch.Tensor):
            t.grad = None


def least_disturbed(seconds: Sequence[float]) -> float:
    """The figure of repeated timings of one operation: their minimum. Load from other processes
    only ever adds time, so the fastest run is the one it disturbed least; a median still moved
    with a load that lasted half the runs (three compiles of one model chose three plans)."""
    return min(seconds)


def timed(fn: Callable[[], Any], device: torch.device) -> tuple[float, Any]:
    """Seconds `fn` takes on `device` (synchronised before and after on CUDA), and its result."""
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
