"""Timing for bench/simulator_accuracy.py: every instruction the in-process runtime executes, the
pipeline's steps, and each stage's forward and backward outside the pipeline (alone and all devices at once).

Not a benchmark itself. The script imports it as `_accuracy_timing` (bench/ is on sys.path when a
script in it runs).
"""

from __future__ import annotations

import collections
import resource
import statistics
import threading
import time

import torch
from _accuracy_plans import Model

from stagewise.runtime.handlers import InstructionHandlers
from stagewise.runtime.worker import StageWorker


class Recorder:
    """Times every instruction the in-process runtime executes, while `on`; while `capture`, keeps a
    copy of each stage's inputs for microbatch 0 (to time the stages on their own afterwards)."""

    def __init__(self):
        self.on = False
        self.capture = False
        self.spans: list[tuple] = []
        self.inputs: dict[int, dict[str, torch.Tensor]] = {}
        self.lock = threading.Lock()
        self.original = InstructionHandlers.dispatch
        self.original_forward = StageWorker.forward

    def install(self) -> None:
        recorder, original, forward = self, self.original, self.original_forward

        def _forward(worker, microbatch, instruction, stash=True):
            if recorder.capture and microbatch == 0 and worker.stage.index not in recorder.inputs:
                recorder.inputs[worker.stage.index] = {
                    k: v.detach().clone().requires_grad_(v.requires_grad) if isinstance(v, torch.Tensor) else v
                    for k, v in worker.inputs[microbatch].items()}
            forward(worker, microbatch, instruction, stash)

        StageWorker.forward = _forward

        def dispatch(handlers, device, index, ins):
            usage = resource.getrusage(resource.RUSAGE_THREAD)
            start, cpu = time.perf_counter(), time.thread_time()
            result = original(handlers, device, index, ins)
            if recorder.on:
                end, cpu = time.perf_counter(), time.thread_time() - cpu
                after = resource.getrusage(resource.RUSAGE_THREAD)
                kernel = (after.ru_stime - usage.ru_stime, after.ru_minflt - usage.ru_minflt)
                with recorder.lock:
                    recorder.spans.append((device, ins, start, end, cpu, kernel))
            return result

        InstructionHandlers.dispatch = dispatch

    def uninstall(self) -> None:
        InstructionHandlers.dispatch = self.original
        StageWorker.forward = self.original_forward


RECORDER = Recorder()


def step_times(pipe, model: Model, warmup: int, steps: int, record: bool = False) -> list[float]:
    RECORDER.inputs.clear()
    RECORDER.capture = record
    try:
        for _ in range(warmup):
            pipe.step(*model.inputs, target=model.target)
    finally:
        RECORDER.capture = False
    times = []
    RECORDER.spans.clear()
    RECORDER.on = record
    try:
        for _ in range(steps):
            start = time.perf_counter()
            pipe.step(*model.inputs, target=model.target)
            times.append(time.perf_counter() - start)
    finally:
        RECORDER.on = False
    return times


def timed_stage_step(worker, args: list) -> tuple[float, float]:
    """Seconds of the stage module's forward and of autograd's backward on fresh copies of `args`."""
    fresh = [a.detach().clone().requires_grad_(a.requires_grad) if isinstance(a, torch.Tensor) else a for a in args]
    start = time.perf_counter()
    outputs = worker.module(*fresh)
    middle = time.perf_counter()
    roots = [o for o in outputs if isinstance(o, torch.Tensor) and o.requires_grad]
    if roots:
        torch.autograd.backward(roots, [torch.ones_like(o) for o in roots])
    return middle - start, time.perf_counter() - middle


def stage_seconds(pipe, repeats: int = 5) -> tuple[dict, dict, float]:
    """Each stage's forward and backward on microbatch 0's real inputs, timed in this thread with no
    other thread running: (plain: the stage module and autograd, as the profiler times a layer;
    worker: through StageWorker.forward / backward, the code path the runtime runs), medians; and the
    minor page faults per worker F or B."""
    plain, worker_path = {}, {}
    faults = instructions = 0
    for worker in pipe._workers:
        inputs = RECORDER.inputs.get(worker.stage.index)
        if inputs is None:
            continue
        args = [inputs[name] for name in worker.stage.inputs]
        f_times, b_times = [], []
        for _ in range(repeats + 1):
            forward_s, backward_s = timed_stage_step(worker, args)
            f_times.append(forward_s)
            b_times.append(backward_s)
        worker.module.zero_grad(set_to_none=True)
        plain[worker.stage.index] = (statistics.median(f_times[1:]), statistics.median(b_times[1:]))
        mb = 10**6  # a microbatch index the pipeline never uses
        f_times, b_times = [], []
        for _ in range(repeats + 1):
            for name, value in inputs.items():
                worker.provide(mb, name, value.detach().clone() if isinstance(value, torch.Tensor) else value)
            before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
            start = time.perf_counter()
            worker.forward(mb, "timing F")
            middle = time.perf_counter()
            for k, name in enumerate(worker.stage.outputs):
                value = worker.outputs[mb][k]
                if isinstance(value, torch.Tensor) and value.requires_grad and not (worker.is_last and k == 0):
                    worker.add_output_grad(mb, name, torch.ones_like(value), ("timing", name))
            worker.backward(mb, 1.0, "timing B")
            end = time.perf_counter()
            faults += resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before
            instructions += 2
            worker.input_grads.pop(mb, None)
            f_times.append(middle - start)
            b_times.append(end - middle)
        worker.module.zero_grad(set_to_none=True)
        worker.pool.release(("grads", worker.stage.index))
        worker_path[worker.stage.index] = (statistics.median(f_times[1:]), statistics.median(b_times[1:]))
    return plain, worker_path, faults / instructions if instructions else 0.0


def concurrent_stage_seconds(pipe, seconds: float = 0.8) -> dict[int, tuple[float, float]]:
    """Each stage's forward and backward (stage module and autograd, as in `stage_seconds`) while every
    device runs its own stages in a loop in its own thread at the same time, without the runtime:
    how much the devices of one process slow each other down (cores, GIL, memory bandwidth)."""
    by_device = collections.defaultdict(list)
    for worker in pipe._workers:
        inputs = RECORDER.inputs.get(worker.stage.index)
        if inputs is not None:
            by_device[worker.stage.device].append((worker, [inputs[name] for name in worker.stage.inputs]))
    times = collections.defaultdict(lambda: ([], []))
    stop = time.perf_counter() + seconds

    def loop(stages) -> None:
        while time.perf_counter() < stop:
            for worker, args in stages:
                forward_s, backward_s = timed_stage_step(worker, args)
                times[worker.stage.index][0].append(forward_s)
                times[worker.stage.index][1].append(backward_s)

    threads = [threading.Thread(target=loop, args=(stages,)) for stages in by_device.values()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for worker in pipe._workers:
        worker.module.zero_grad(set_to_none=True)
    return {s: (statistics.median(f), statistics.median(b)) for s, (f, b) in times.items() if f}
