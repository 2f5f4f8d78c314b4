"""The runtime: stream threads, events, the memory pool, and errors instead of hangs."""

import gc
import threading
import time
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

import stagewise as sw
from stagewise.ir.instructions import Forward, Recv, Send
from stagewise.ir.program import Program
from tests.models.gpt import TinyGPT, lm_loss
from tests.models.mlp import mlp
from tests.reference import first_device_peak

X, Y = torch.randn(8, 8), torch.randint(0, 5, (8,))


def compile_mlp(devices=3, **kwargs):
    return sw.compile(mlp(), devices, (X,), loss_fn=F.cross_entropy, example_target=Y, microbatches=4, **kwargs)


def test_every_instruction_names_its_events():
    pipe = compile_mlp()
    program = pipe.programs[1]
    for index, ins in enumerate(program.instructions):
        assert all(j < index and program.instructions[j].stream is not ins.stream for j in ins.waits)
        if isinstance(ins, Forward):
            (recv,) = [program.instructions[j] for j in ins.waits]
            assert isinstance(recv, Recv) and recv.microbatch == ins.microbatch


def test_stats_count_peak_stash_and_p2p():
    pipe = compile_mlp(schedule="gpipe")
    pipe.step(X, target=Y)
    stats = pipe.stats
    assert [s["device"] for s in stats] == [0, 1, 2]
    for s in stats:
        assert s["peak_bytes"] >= s["weights_bytes"] + s["optimizer_bytes"] > 0
        assert s["stash_bytes"] == 0 and s["buffer_bytes"] == 0  # everything released after the step
    # every activation and gradient crossing a cut was counted once by its sender
    crossing = sum(t.bytes_per_sample for t in pipe.plan.transfers) * 8
    assert sum(s["p2p_bytes"] for s in stats) == pytest.approx(2 * crossing)
    pipe.step(X, target=Y)
    assert sum(s["reused_buffers"] for s in pipe.stats) > 0  # transfer buffers are recycled


def test_time_breakdown_names_every_stream_and_sums_what_ran():
    pipe = compile_mlp()
    before = pipe.time_breakdown()  # before the first step nothing ran (an AttributeError once)
    assert [r["device"] for r in before] == [0, 1, 2]
    assert all(seconds == 0.0 for row in before for name, seconds in row.items() if name != "device")
    pipe.step(X, target=Y)
    rows = pipe.time_breakdown()
    assert [r["device"] for r in rows] == [0, 1, 2]
    for row in rows:
        assert set(row) == {"device", "step_s", "compute_s", "waiting_s", "dispatch_s", "inline_s", "idle_s",
                            "swap_in_s", "swap_out_s", "p2p_in_s", "p2p_out_s"}
        assert 0 < row["compute_s"] <= row["step_s"]
    spans = {(d, s): 0.0 for d, s, *_ in pipe._executor.state.step.timeline}
    for device, stream, _, start, end in pipe._executor.state.step.timeline:
        spans[(device, stream)] += end - start
    assert rows[1]["p2p_in_s"] == pytest.approx(sum(v for (d, s), v in spans.items() if d == 1 and s.value == "p2p_in"))


def test_one_f_one_b_stashes_less_than_gpipe():
    assert first_device_peak(TinyGPT(), 4, "1f1b") < first_device_peak(TinyGPT(), 4, "gpipe")


def test_capacity_is_enforced_with_a_clear_error():
    ids = torch.randint(0, 64, (8, 8))
    probe = sw.compile(TinyGPT(), 2, (ids,), loss_fn=lm_loss, example_target=ids, microbatches=4,
                       split_points=["blocks.2"])
    probe.step(ids, target=ids)
    weights = probe.stats[1]["weights_bytes"]
    devices = [sw.Device("cpu"), sw.Device("cpu", memory=weights + 1024)]
    # the planner would avoid this; a fixed split and no swapping make the pool enforce the limit
    pipe = sw.compile(TinyGPT(), devices, (ids,), loss_fn=lm_loss, example_target=ids, microbatches=4, swap="off",
                      split_points=["blocks.2"])
    with pytest.raises(sw.CapacityError, match=r"device 1 \(cpu\) needs [\d.]+ KiB more for (buffer|stash) at `dev\d #\d+ .*mb=0.*` but already holds"):
        pipe.step(ids, target=ids)


def test_inconsistent_programs_are_a_deadlock_error_not_a_hang():
    pipe = compile_mlp()
    program = pipe.plan.programs[2]
    # drop device 2's first gradient send: device 1 then waits for a message that never comes
    first_send = next(i for i, ins in enumerate(program.instructions) if isinstance(ins, Send))
    broken = Program(2, program.instructions[:first_send] + program.instructions[first_send + 1 :])
    pipe._executor.programs = pipe.plan.programs[:2] + (_renumber(broken, first_send),)
    with pytest.raises(sw.PlanError, match="deadlock"):
        pipe.step(X, target=Y)
    del pipe
    gc.collect()
    time.sleep(0.1)
    assert threading.active_count() < 5  # every stream thread was idle and ended with its pipeline


def test_a_failing_stream_stops_every_device_and_reports_the_error():
    pipe = compile_mlp()

    def explode(*args, **kwargs):
        raise RuntimeError("simulated device failure")

    pipe._workers[1].forward = explode
    with pytest.raises(RuntimeError, match="simulated device failure"):
        pipe.step(X, target=Y)


def test_silent_peer_times_out():
    pipe = compile_mlp()
    pipe._executor.state.timeout_s = 0.5
    original = pipe._runtime.transport.send

    def lose_messages_to_device_2(key, src, dst, tensor, instruction):
        if dst != 2:
            original(key, src, dst, tensor, instruction)

    pipe._runtime.transport.send = lose_messages_to_device_2
    # device 2 waits for its activation; devices 0 and 1 keep waiting for gradients: a deadlock
    # among the threads of this process is detected at once, before the timeout.
    with pytest.raises((sw.PeerError, sw.PlanError)):
        pipe.step(X, target=Y)


def _renumber(program: Program, removed: int) -> Program:
    """Shift event indices after removing instruction `removed`."""
    fixed = []
    for ins in program.instructions:
        waits = tuple(j - (j > removed) for j in ins.waits if j != removed)
        fixed.append(replace(ins, waits=waits))
    return Program(program.device, tuple(fixed))


def test_gradient_bytes_drop_when_a_counted_gradient_is_dropped():
    """The pool's gradient bytes after a backward that left a parameter's (counted, since freed)
    gradient None: its dead reference gives None too, and once matched that, keeping the old count."""
    from stagewise.runtime.grad_bytes import GradBytes

    params = {name: torch.nn.Parameter(torch.zeros(4)) for name in ("a", "b")}
    for param in params.values():
        param.grad = torch.ones(4)
    counter = GradBytes(params)
    assert counter.count() == 32
    params["a"].grad = None
    assert counter.count() == 16
    params["a"].grad = torch.ones(4)
    assert counter.count() == 32
