"""A quick measurement of the local devices, so costs use this machine's numbers, not datasheets.

Three figures per device, each from a few repetitions of one small operation (the best
repetition counts: noise only ever makes an operation slower): the bandwidth of a copy
within the device's memory, the bandwidth of the host <-> device link (a swap; on a CPU
device the same as a copy), and the FLOP/s of an fp32 matmul, from which relative speeds
follow. Between two logical devices the send bandwidth is that of a copy from one to the
other, which is what a transfer inside one process is. Every figure here is the least disturbed of
several repeats and is kept per machine (passes/machine_cache.py): measured once on a machine (well
under a second on a CPU), read back by every later process, so a plan does not follow the load.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from stagewise.ir.devices import Device, resolve_devices, torch_device
from stagewise.ir.topology import Topology
from stagewise.passes.machine_cache import remembered
from stagewise.passes.profile_measure import least_disturbed
from stagewise.runtime.sync import Sync

COPY_BYTES = 8 * 2**20  # large enough to be bandwidth-bound, small enough to stay fast
MATMUL_N = 256
REPEATS = 5
OPTIMIZER_ELEMENTS = 2**20  # one 4 MiB parameter: the per-byte cost of a step
OPTIMIZER_TENSORS = 64  # small parameters: the per-tensor cost
HANDOFF_ROUNDS = 200  # hand-offs timed together ...
HANDOFF_REPEATS = 5  # ... this many times, the least disturbed kept (one timing read 10 to 34 µs here)


@dataclass(frozen=True)
class Calibration:
    """Measured figures of one device: bytes/s of copies, FLOP/s of a matmul."""

    device: str
    kind: str
    copy_bandwidth: float
    host_bandwidth: float
    matmul_flops: float


def calibrate(device: str | torch.device | Device = "cpu") -> Calibration:
    """Measure (once per machine and device) copy and host-link bandwidth and matmul FLOP/s."""
    name = str(_torch_device(device))
    return remembered("calibration", name, functools.partial(_calibrate, name), Calibration)


@functools.cache
def _calibrate(name: str) -> Calibration:
    device = torch.device(name)
    src = torch.empty(COPY_BYTES // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    copy_s = best_seconds(lambda: dst.copy_(src), device)
    if device.type == "cuda":
        host = torch.empty(COPY_BYTES // 4, dtype=torch.float32, pin_memory=True)
        host_s = max(best_seconds(lambda: src.copy_(host, non_blocking=True), device),
                     best_seconds(lambda: host.copy_(src, non_blocking=True), device))
    else:
        host_s = copy_s
    a = torch.randn(MATMUL_N, MATMUL_N, device=device)
    b = torch.randn(MATMUL_N, MATMUL_N, device=device)
    matmul_s = best_seconds(lambda: torch.mm(a, b), device)
    return Calibration(
        device=name,
        kind=device.type,
        copy_bandwidth=COPY_BYTES / copy_s,
        host_bandwidth=COPY_BYTES / host_s,
        matmul_flops=2 * MATMUL_N**3 / matmul_s,
    )


def send_bandwidth(src: str | torch.device | Device, dst: str | torch.device | Device) -> float:
    """Bytes/s of a transfer between two logical devices of this process: a copy from src to dst."""
    names = (str(_torch_device(src)), str(_torch_device(dst)))
    return remembered("send", names, functools.partial(_send_bandwidth, *names), float)


@functools.cache
def _send_bandwidth(src_name: str, dst_name: str) -> float:
    src, dst = torch.device(src_name), torch.device(dst_name)
    if src == dst:
        return calibrate(src_name).copy_bandwidth
    a = torch.empty(COPY_BYTES // 4, dtype=torch.float32, device=src)
    b = torch.empty(COPY_BYTES // 4, dtype=torch.float32, device=dst)
    return COPY_BYTES / best_seconds(lambda: b.copy_(a, non_blocking=True), src, dst)


def relative_speeds(devices) -> list[float]:
    """Matmul FLOP/s of each device over that of the first (the device costs are profiled on)."""
    flops = [calibrate(d).matmul_flops for d in resolve_devices(devices)]
    return [f / flops[0] for f in flops]


def local_topology(devices) -> Topology:
    """The measured send bandwidth between every pair of the given local devices."""
    resolved = resolve_devices(devices)
    return Topology.from_matrix(
        [[send_bandwidth(a, b) if i != j else None for j, b in enumerate(resolved)]
         for i, a in enumerate(resolved)]
    )


def _torch_device(device: str | torch.device | Device) -> torch.device:
    device = device.torch_device if isinstance(device, Device) else torch_device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def best_seconds(op: Callable[[], object], *devices: torch.device, repeats: int = REPEATS) -> float:
    """Seconds of the fastest (least disturbed) of `repeats` runs of op, after one warm-up run."""
    op()
    return max(least_disturbed([_seconds(op, *devices) for _ in range(repeats)]), 1e-9)


def _seconds(op: Callable[[], object], *devices: torch.device) -> float:
    """Seconds of one run of op, the devices' queued work included."""
    _sync(devices)
    start = time.perf_counter()
    op()
    _sync(devices)
    return time.perf_counter() - start


def _sync(devices: Sequence[torch.device]) -> None:
    for device in devices:
        if device.type == "cuda":
            torch.cuda.synchronize(device)


def optimizer_state_ratio(optimizer_factory) -> float:
    """Bytes of optimizer state per parameter byte, measured: one step of the user's optimizer on a
    small parameter (SGD 0, SGD with momentum 1, Adam/AdamW 2). Scalar state (step counts) is ignored."""
    param = torch.nn.Parameter(torch.zeros(64))
    optimizer = optimizer_factory([param])
    param.grad = torch.ones_like(param)
    optimizer.step()
    state = sum(v.numel() * v.element_size() for s in optimizer.state.values() for v in s.values()
                if isinstance(v, torch.Tensor) and v.dim() > 0)
    return state / (param.numel() * param.element_size())


@dataclass(frozen=True)
class OptimizerCost:
    """One optimizer step's seconds: a fixed part per parameter tensor plus a part per byte."""

    per_tensor_s: float
    per_byte_s: float

    def seconds(self, tensors: int, nbytes: int) -> float:
        return tensors * self.per_tensor_s + nbytes * self.per_byte_s


def optimizer_cost(optimizer_factory, device: str | torch.device | Device = "cpu") -> OptimizerCost:
    """Time the user's optimizer on `device`: one large parameter (bandwidth-bound) and many small
    ones (per-tensor overhead), so the planner can charge each stage's update (U). Measured once
    per machine for an optimizer (keyed by the factory's repr) and device."""
    device = _torch_device(device)
    return remembered("optimizer", (repr(optimizer_factory), str(device)),
                      functools.partial(_measure_optimizer, optimizer_factory, device), OptimizerCost)


CACHE_FLUSH_BYTES = 64 * 2**20  # more than a CPU's last-level cache


def _measure_optimizer(optimizer_factory, device: torch.device) -> OptimizerCost:
    """On a CPU each timed step starts with cold caches: in a pipeline the update comes after the
    stage's backward has moved other data through them (hot, an SGD step over 64k floats took 34 µs
    here, cold 270 µs; the runtime's updates measured 2.4x a hot calibration)."""
    flush = torch.empty(CACHE_FLUSH_BYTES // 4) if device.type == "cpu" else None

    def step_seconds(params: list[torch.nn.Parameter]) -> float:
        for p in params:
            p.grad = torch.full_like(p, 1e-3)
        step = optimizer_factory(params).step
        step()
        times = []
        for _ in range(5):
            if flush is not None:
                flush.fill_(1.0)
            times.append(_seconds(step, device))
        return least_disturbed(times)

    large = [torch.nn.Parameter(torch.zeros(OPTIMIZER_ELEMENTS, device=device))]
    small = [torch.nn.Parameter(torch.zeros(64, device=device)) for _ in range(OPTIMIZER_TENSORS)]
    per_tensor = step_seconds(small) / OPTIMIZER_TENSORS
    per_byte = max(step_seconds(large) - per_tensor, 0.0) / (OPTIMIZER_ELEMENTS * 4)
    return OptimizerCost(per_tensor, per_byte)


def handoff_seconds() -> float:
    """Seconds one stream thread of the in-process runtime takes to see an event another stream
    thread sets (a `Sync` wake-up and the GIL hand-off): the simulator charges it per instruction.
    Measured once per machine by two threads passing a counter back and forth, the least disturbed
    of HANDOFF_REPEATS timings."""
    return remembered("handoff", HANDOFF_ROUNDS, _least_disturbed_handoff, float)


def _least_disturbed_handoff() -> float:
    return least_disturbed([_handoff(HANDOFF_ROUNDS) for _ in range(HANDOFF_REPEATS)])


def _handoff(rounds: int) -> float:
    """Seconds per hand-off of two threads passing a counter back and forth `rounds` times each."""
    sync, state = Sync(2, timeout_s=10.0), {"turn": 0}

    def turn_is(turn: int) -> bool:
        return state["turn"] == turn

    def play(parity: int) -> None:
        for i in range(rounds):
            sync.wait_until(functools.partial(turn_is, 2 * i + parity), "handoff", ["turn"])
            with sync.locked():
                state["turn"] += 1
                sync.changed("turn")
        sync.thread_done()

    other = threading.Thread(target=play, args=(1,), daemon=True)
    start = time.perf_counter()
    other.start()
    play(0)
    other.join()
    return (time.perf_counter() - start) / (2 * rounds)
