"""Timing for bench/simulator_accuracy.py: every instruction the runtime executed (read from each
step's own timeline), the pipeline's steps, and each stage's forward and backward outside the pipeline
(alone and all devices at once).

Not a benchmark itself. The script imports it as `_accuracy_timing` (bench/ is on sys.path when a
script in it runs). Nothing of the runtime is patched: the instructions' spans are the executor's
timeline (`pipe._executor.state.step.timeline`), the stream threads' CPU time and page faults come
from the OS per thread, and microbatch 0's stage inputs from a forward pre-hook on each stage module.
"""

from __future__ import annotations

import collections
import contextlib
import os
import resource
import statistics
import threading
import time
from dataclasses import dataclass

import torch
from _accuracy_plans import Model

from stagewise.ir.instructions import Instruction


@dataclass
class ThreadUsage:
    """CPU seconds, kernel seconds and minor page faults of the step's stream threads, summed."""

    cpu_s: float = 0.0
    system_s: float = 0.0
    minor_faults: int = 0


def thread_usage() -> dict[int, ThreadUsage] | None:
    """Each Python thread but the main one (the runtime's long-lived stream threads; the main thread
    only waits for a step), by native id, from the OS's per-thread counters; None without /proc or
    per-thread CPU clocks (not Linux)."""
    if not os.path.isdir("/proc/self/task") or not hasattr(time, "pthread_getcpuclockid"):
        return None
    usage, tick = {}, 1 / os.sysconf("SC_CLK_TCK")
    for thread in threading.enumerate():
        if thread is threading.main_thread() or thread.native_id is None or thread.ident is None:
            continue
        try:
            with open(f"/proc/self/task/{thread.native_id}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()  # after the thread's name, which may hold spaces
            cpu_s = time.clock_gettime(time.pthread_getcpuclockid(thread.ident))
        except OSError:  # the thread ended meanwhile (no such task): it ran no step
            continue
        # proc(5): minflt is field 10, stime field 15; fields[0] here is field 3
        usage[thread.native_id] = ThreadUsage(cpu_s, int(fields[12]) * tick, int(fields[7]))
    return usage


def usage_between(before: dict[int, ThreadUsage] | None, after: dict[int, ThreadUsage] | None) -> ThreadUsage | None:
    """What the threads alive at both snapshots used in between."""
    if before is None or after is None:
        return None
    total = ThreadUsage()
    for tid in before.keys() & after.keys():
        total.cpu_s += after[tid].cpu_s - before[tid].cpu_s
        total.system_s += after[tid].system_s - before[tid].system_s
        total.minor_faults += after[tid].minor_faults - before[tid].minor_faults
    return total


class Recorder:
    """The timed steps' instructions, as (device, instruction, start, end) in perf_counter seconds, and
    the stream threads' usage over them; microbatch 0's inputs of each stage, captured in warm-up (to
    time the stages on their own afterwards)."""

    def __init__(self):
        self.spans: list[tuple[int, Instruction, float, float]] = []
        self.usage: ThreadUsage | None = None
        self.inputs: dict[int, dict[str, torch.Tensor]] = {}

    def record_step(self, pipe) -> None:
        """Append the last step's instructions, from the executor's timeline of it."""
        step = pipe._executor.state.step
        code = {p.device: p.instructions for p in pipe.plan.programs}
        self.spans.extend((device, code[device][index], step.started_at + start, step.started_at + end)
                          for device, _, index, start, end in step.timeline)

    @contextlib.contextmanager
    def capturing(self, pipe):
        """Keep a copy of each stage's first forward inputs (microbatch 0 in every schedule) while inside."""
        def hook_for(worker):
            def keep(module, args):
                if worker.stage.index not in self.inputs:
                    self.inputs[worker.stage.index] = {
                        name: v.detach().clone().requires_grad_(v.requires_grad) if isinstance(v, torch.Tensor) else v
                        for name, v in zip(worker.stage.inputs, args, strict=True)}
            return keep
        handles = [worker.module.register_forward_pre_hook(hook_for(worker)) for worker in pipe._workers]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()


RECORDER = Recorder()


def step_times(pipe, model: Model, warmup: int, steps: int, record: bool = False) -> list[float]:
    """Each timed step's seconds; with `record`, also RECORDER's spans, usage and stage inputs."""
    RECORDER.inputs.clear()
    with RECORDER.capturing(pipe) if record else contextlib.nullcontext():
        for _ in range(warmup):
            pipe.step(*model.inputs, target=model.target)
    times = []
    RECORDER.spans.clear()
    before = thread_usage() if record else None
    for _ in range(steps):
        start = time.perf_counter()
        pipe.step(*model.inputs, target=model.target)
        times.append(time.perf_counter() - start)
        if record:
            RECORDER.record_step(pipe)
    RECORDER.usage = usage_between(before, thread_usage()) if record else None
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
