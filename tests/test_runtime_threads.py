"""The runtime's threads: the `Sync` monitor's wake-ups, deadlock and timeout, threadless p2p and swap streams,
and the prebound calls a step runs."""

import threading

import pytest
import torch
import torch.nn.functional as F

import stagewise as sw
from stagewise.ir.instructions import Carried, Recv, Stream
from stagewise.ir.program import Program
from stagewise.runtime import executor_state
from stagewise.runtime.handlers import InstructionHandlers
from stagewise.runtime.sync import Aborted, Sync
from tests.models.gpt import TinyGPT, lm_loss
from tests.models.mlp import mlp
from tests.reference import check_equal_training, token_batches

X, Y = torch.randn(8, 8), torch.randint(0, 5, (8,))


@pytest.fixture
def thread_per_device(monkeypatch):
    """The threaded strategy whatever cores this process may use (on one core the devices of a
    process share one thread, runtime/serial.py)."""
    monkeypatch.setattr(executor_state, "one_core", lambda: False)


def compile_mlp(devices=3, **kwargs):
    return sw.compile(mlp(), devices, (X,), loss_fn=F.cross_entropy, example_target=Y, microbatches=4, **kwargs)


def _play(sync: Sync, state: dict, parity: int, rounds: int) -> None:
    try:
        for i in range(rounds):
            sync.wait_until(lambda i=i: state["turn"] == 2 * i + parity, "turn", ["turn"])
            with sync.locked():
                state["turn"] += 1
                sync.changed("turn")
    except Aborted:
        pass
    finally:
        sync.thread_done()


def test_two_threads_hand_a_counter_back_and_forth():
    sync, state = Sync(2, timeout_s=30.0), {"turn": 0}
    other = threading.Thread(target=_play, args=(sync, state, 1, 500))
    other.start()
    _play(sync, state, 0, 500)
    other.join()
    assert sync.error is None and state["turn"] == 1000


def test_threads_waiting_on_each_other_are_a_deadlock():
    sync = Sync(2, timeout_s=30.0)
    raised = []

    def wait_for(key: str) -> None:
        try:
            sync.wait_until(lambda: False, f"waits for {key}", [key])
        except Aborted:
            raised.append(key)
        finally:
            sync.thread_done()

    threads = [threading.Thread(target=wait_for, args=(key,)) for key in ("a", "b")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(raised) == ["a", "b"]
    assert isinstance(sync.error, sw.PlanError) and "deadlock" in str(sync.error)


def test_a_wait_nobody_answers_times_out_while_another_thread_works():
    sync, working = Sync(2, timeout_s=0.2), threading.Event()
    worker = threading.Thread(target=working.wait)  # alive and not waiting in the monitor: no deadlock
    worker.start()
    with pytest.raises(Aborted):
        sync.wait_until(lambda: False, "a message", ["message"])
    working.set()
    worker.join()
    assert isinstance(sync.error, sw.PeerError)


def test_cpu_p2p_streams_run_without_threads_in_program_order(thread_per_device):
    pipe = compile_mlp()
    loss = pipe.step(X, target=Y)
    executor = pipe._executor
    assert torch.isfinite(loss)
    for program in executor.programs:
        assert executor.state.step.threadless[program.device].streams == (Stream.P2P_IN, Stream.P2P_OUT)
        for stream in (Stream.P2P_IN, Stream.P2P_OUT):
            ran = sorted((start, index) for device, s, index, start, _ in executor.state.step.timeline
                         if device == program.device and s is stream)
            assert [index for _, index in ran] == executor.state.tables[program.device].order[stream]
    assert set(executor.threads.queues) == {(p.device, Stream.COMPUTE) for p in executor.programs}


def _ran_in_program_order(executor, device: int, stream: Stream) -> bool:
    ran = sorted((start, index) for d, s, index, start, _ in executor.state.step.timeline if d == device and s is stream)
    return [index for _, index in ran] == executor.state.tables[device].order[stream]


def test_cpu_swap_streams_run_on_the_devices_compute_threads(thread_per_device):
    """Issue 23: a CPU device keeps one compute thread; its swaps (host copies) run inline, in program
    order, and training stays eager's (before: a thread per swap stream, a hand-off per swap)."""
    pipe = check_equal_training(TinyGPT(layers=2), token_batches(steps=2), 2, loss_fn=lm_loss, microbatches=2,
                                schedule="1f1b", swap="on")
    executor = pipe._executor
    for program in executor.programs:
        swaps = tuple(s for s in (Stream.SWAP_IN, Stream.SWAP_OUT) if executor.state.tables[program.device].order[s])
        assert swaps and set(swaps) <= set(executor.state.step.threadless[program.device].streams)
        assert all(_ran_in_program_order(executor, program.device, s) for s in swaps)
    assert set(executor.threads.queues) == {(p.device, Stream.COMPUTE) for p in executor.programs}


def test_a_step_runs_the_calls_bound_when_the_programs_were_loaded(monkeypatch):
    """Lower once, run many: each instruction is bound to its handler once per program (here: on
    replacing the programs), and a step dispatches nothing by type (before: a lookup per instruction)."""
    pipe = compile_mlp()
    bound = []
    bind = InstructionHandlers.bind
    monkeypatch.setattr(InstructionHandlers, "bind", lambda self, *args: bound.append(args) or bind(self, *args))
    pipe._executor.programs = pipe._executor.programs
    assert len(bound) == sum(len(p.instructions) for p in pipe.programs)

    def no_dispatch(*args):
        raise AssertionError("a step looked a handler up by type")
    monkeypatch.setattr(InstructionHandlers, "dispatch", no_dispatch)
    for _ in range(2):
        assert torch.isfinite(pipe.step(X, target=Y))
    assert len(bound) == sum(len(p.instructions) for p in pipe.programs)


def test_a_receive_whose_message_never_comes_is_a_deadlock_error():
    pipe = compile_mlp()
    program = pipe._executor.programs[2]
    stray = Recv(stage=2, microbatch=99, carries=Carried.ACTIVATIONS, peer=1, peer_stage=1, values=("nothing",))
    pipe._executor.programs = pipe._executor.programs[:2] + (Program(2, program.instructions + (stray,)),)
    with pytest.raises(sw.PlanError, match=f"deadlock.*dev2 #{len(program.instructions)} "):
        pipe.step(X, target=Y)
