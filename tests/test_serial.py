"""Every device of a process on one thread, where they could not compute in parallel anyway
(runtime/serial.py): the order fixed at load is legal, training stays eager's, a failed step is
rolled back, the time split adds up, and where no such order exists the threads run the step."""

import copy

import pytest
import torch
import torch.nn.functional as F

import stagewise as sw
from stagewise.ir.instructions import Recv, Send, Stream
from stagewise.runtime import executor_state
from stagewise.runtime.serial import serial_order
from stagewise.runtime.sync import Sync
from tests.harness.faults import TWO, rolled_back_as_eager, stuck_stage_meets_the_deadline
from tests.harness.measured import assert_parts_add_up
from tests.models.mlp import mlp
from tests.reference import check_equal_training

X, Y = torch.randn(8, 8), torch.randint(0, 5, (8,))


@pytest.fixture
def one_core(monkeypatch):
    """This process as if it may run on one core: its devices share one thread."""
    monkeypatch.setattr(executor_state, "one_core", lambda: True)


def ran_legally(executor) -> None:
    """Each stream in program order, each instruction after its events, each receive after its sends."""
    timeline = executor.state.step.timeline
    position = {(device, index): n for n, (device, _, index, _, _) in enumerate(timeline)}
    assert len(position) == sum(len(p.instructions) for p in executor.programs)
    for program in executor.programs:
        tables = executor.state.tables[program.device]
        for stream in Stream:
            ran = [index for device, s, index, _, _ in timeline if device == program.device and s is stream]
            assert ran == tables.order[stream]
        for index, ins in enumerate(program.instructions):
            assert all(position[(program.device, j)] < position[(program.device, index)] for j in ins.waits)
    sent = {key: (program.device, index) for program in executor.programs
            for index, ins in enumerate(program.instructions) if isinstance(ins, Send)
            for _, key in executor.state.tables[program.device].messages[index]}
    for program in executor.programs:
        for index, ins in enumerate(program.instructions):
            if isinstance(ins, Recv):
                for key in executor.state.tables[program.device].incoming[index]:
                    assert position[sent[key]] < position[(program.device, index)]


@pytest.mark.parametrize(("devices", "options"), [(1, {}), (3, {"schedule": "1f1b"}), (2, {"schedule": "gpipe", "swap": "on"})],
                         ids=["one-device", "three-devices-1f1b", "two-devices-swapping"])
def test_one_thread_runs_every_device_legally_and_trains_as_eager(one_core, devices, options):
    batches = [((torch.randn(8, 8),), torch.randint(0, 5, (8,))) for _ in range(2)]
    pipe = check_equal_training(mlp(), batches, devices, loss_fn=F.cross_entropy, microbatches=4, **options)
    executor = pipe._executor
    assert executor.state.serial_step() is not None
    assert set(executor.threads.queues) == {(executor.programs[0].device, Stream.COMPUTE)}
    ran_legally(executor)


def test_a_step_on_one_core_blocks_no_thread(one_core, monkeypatch):
    """Issue 23: where 4 devices' threads shared one core, a step parked and woke them dozens of times."""
    pipe = sw.compile(mlp(depth=8), 4, (X,), loss_fn=F.cross_entropy, example_target=Y, microbatches=8,
                      schedule="1f1b", cost="analytic")
    blocked = []
    block = Sync._block
    monkeypatch.setattr(Sync, "_block", lambda self, *args: blocked.append(args) or block(self, *args))
    assert torch.isfinite(pipe.step(X, target=Y))
    assert blocked == []
    for row in pipe.time_breakdown():  # each device's part of the one thread's time, waiting the rest
        assert_parts_add_up(row, float("inf"))
        assert row.compute_s > 0 and row.waiting_s > 0


def test_a_failed_step_on_one_thread_is_rolled_back(one_core):
    """tests/test_atomic_step.py's faults (forward, backward, update) on one thread: each step rolled back."""
    rolled_back_as_eager("1f1b", {"split_points": TWO}, batchnorm=True)


def test_threads_run_what_one_thread_cannot(one_core):
    """An all-reduce between devices blocks until every member joined: no one-thread order."""
    pipe = sw.compile(mlp(), 2, (X,), loss_fn=F.cross_entropy, example_target=Y, microbatches=2,
                      clip_grad_norm=1.0, cost="analytic")
    state = pipe._executor.state
    assert serial_order(state.programs, state.tables, state.device_of) is None and state.serial_step() is None
    assert torch.isfinite(pipe.step(X, target=Y))
    assert len(pipe._executor.threads.queues) == 2


def test_threads_run_devices_with_a_memory_limit(one_core):
    """On a bounded device a message may wait for room that a later instruction frees (issue 24's
    early arrivals): an order fixed at load would wait for it on the one thread, so threads run it."""
    memory = sw.compile(mlp(), 2, (X,), loss_fn=F.cross_entropy, example_target=Y, microbatches=2,
                        cost="analytic").plan.predicted_peak_bytes
    devices = [sw.Device("cpu", memory=4 * max(memory)), "cpu"]
    pipe = sw.compile(mlp(), devices, (X,), loss_fn=F.cross_entropy, example_target=Y, microbatches=2,
                      cost="analytic")
    state = pipe._executor.state
    assert serial_order(state.programs, state.tables, state.device_of) is not None and state.serial_step() is None
    assert torch.isfinite(pipe.step(X, target=Y))
    assert len(pipe._executor.threads.queues) == 2


def test_one_thread_and_a_thread_per_device_train_bit_for_bit_alike(one_core):
    """The same model, batches and programs, `one_thread` forced off and on: the same losses and weights."""
    torch.manual_seed(0)
    model = mlp()
    pipes = [sw.compile(copy.deepcopy(model), 3, (X,), loss_fn=F.cross_entropy, example_target=Y, microbatches=4,
                        schedule="1f1b", cost="analytic") for _ in range(2)]
    pipes[0]._executor.state.one_thread = False
    assert pipes[0]._executor.state.serial_step() is None and pipes[1]._executor.state.serial_step() is not None
    for _ in range(2):
        x, y = torch.randn(8, 8), torch.randint(0, 5, (8,))
        threaded, walked = (pipe.step(x, target=y) for pipe in pipes)
        assert torch.equal(threaded, walked)
    assert len(pipes[0]._executor.threads.queues) == 3 and len(pipes[1]._executor.threads.queues) == 1
    for name, tensor in pipes[0].state_dict().items():
        assert torch.equal(tensor, pipes[1].state_dict()[name]), name


def test_a_stuck_stage_on_one_thread_meets_the_deadline(one_core, tmp_path):
    """tests/test_atomic_step.py's stuck stage, its devices on one thread: the caller still returns at
    the deadline, and the pipeline waits for the walk before the next step."""
    stuck_stage_meets_the_deadline(tmp_path)
