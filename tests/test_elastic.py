"""Surviving a lost machine: `sw.Checkpoints` and examples/elastic.py under torchrun.

In one process: checkpoints every N steps (or T seconds) keep the newest `keep`, a failed save
removes nothing, a damaged newest one is passed over with a warning for the one before, and a
checkpoint of 2 devices resumes on 1 with its scheduler, bitwise.

Under torchrun (gloo): two agents on localhost play two machines in one elastic job (c10d
rendezvous, `--nnodes=1:2`); rank 1's worker kills its agent and exits at step 5, so that machine
is gone; the survivor's agent restarts its worker alone (WORLD_SIZE=1), which compiles for one
device, restores the newest checkpoint (saved by two ranks) and trains to the end: the losses and
final parameters are the uninterrupted single-process run's. And one agent with two workers,
rank 1 dies, both restart at the same size: that job runs beside the first, started once the lost
machine is gone (its survivor then mostly waits). Every subprocess has a hard deadline, and what the
tests started is killed at the end, whatever happened.
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import stagewise as sw
from stagewise.compiler.checkpoint import write as checkpoint_write
from tests.harness.elastic_example import EXAMPLE, LINE, run_uninterrupted
from tests.harness.two_hosts import pids_naming
from tests.models.mlp import mlp

TORCHRUN = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or shutil.which("torchrun")
DEADLINE_S = 90.0  # a torchrun job that outlives this is killed and the test fails (never a hung suite)
STEPS, EVERY, KEEP, DIE_AT = 8, 2, 3, 5


# ---- in one process ----------------------------------------------------------------------------
def _pipe(devices: int):
    torch.manual_seed(0)
    x, y = torch.randn(8, 8), torch.randint(0, 5, (8,))
    pipe = sw.compile(mlp(), devices, (x,), loss_fn=F.cross_entropy, example_target=y, microbatches=2,
                      optimizer=functools.partial(torch.optim.SGD, lr=0.05, momentum=0.9), cost="analytic")
    scheduler = torch.optim.lr_scheduler.LambdaLR(pipe.optimizer, lambda s: 0.9 ** s)
    return pipe, scheduler


def _batch(step: int):
    generator = torch.Generator().manual_seed(step)
    return torch.randn(8, 8, generator=generator), torch.randint(0, 5, (8,), generator=generator)


def _train(pipe, scheduler, checkpoints, steps: range) -> list[bool]:
    saved = []
    for step in steps:
        x, y = _batch(step)
        pipe.step(x, target=y)
        scheduler.step()
        saved.append(checkpoints.after_step(pipe, scheduler))
    return saved


def _flip_a_byte(checkpoint: Path) -> None:
    shard = next((checkpoint / "weights").glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x5A
    shard.write_bytes(bytes(data))


def test_checkpoints_rotate_resume_on_other_devices_and_pass_over_a_damaged_one(tmp_path, monkeypatch):
    pipe, scheduler = _pipe(2)
    checkpoints = sw.Checkpoints(tmp_path / "ck", every_steps=2, keep=2)
    assert checkpoints.resume(pipe, scheduler) == 0  # nothing saved yet
    assert _train(pipe, scheduler, checkpoints, range(4)) == [False, True, False, True]
    at_4 = {k: v.clone() for k, v in pipe.state_dict().items()}
    lr_at_4 = scheduler.get_last_lr()
    monkeypatch.setattr(pipe, "save", lambda *a, **k: (_ for _ in ()).throw(OSError("disk full")))
    with pytest.raises(OSError, match="disk full"):
        _train(pipe, scheduler, checkpoints, range(4, 6))  # step 6's save fails ...
    assert checkpoints.saved_steps() == [2, 4]  # ... and nothing older is removed
    monkeypatch.undo()
    assert _train(pipe, scheduler, checkpoints, range(6, 8)) == [False, True]
    assert checkpoints.saved_steps() == [4, 8]  # the newest 2, removed only once step_8 was in place
    _flip_a_byte(tmp_path / "ck" / "step_8")

    alone, alone_scheduler = _pipe(1)  # another plan: one device
    again = sw.Checkpoints(tmp_path / "ck", every_steps=2, keep=2)
    with pytest.warns(UserWarning, match="step_8 could not be restored"):
        assert again.resume(alone, alone_scheduler) == 4
    for name, tensor in alone.state_dict().items():
        assert torch.equal(tensor, at_4[name]), name
    assert alone._executor.state.iteration == 4 and alone_scheduler.last_epoch == 4
    assert alone_scheduler.get_last_lr() == lr_at_4 == [g["lr"] for g in alone.optimizer.param_groups]
    assert not again.after_step(alone, alone_scheduler)  # step 4 is saved already
    assert _train(alone, alone_scheduler, again, range(4, 6)) == [False, True]
    assert again.saved_steps() == [4, 6, 8]  # the damaged step_8 is left for the user to look at
    assert sw.load(tmp_path / "ck" / "step_6")._executor.state.iteration == 6

    _flip_a_byte(tmp_path / "ck" / "step_6")
    _flip_a_byte(tmp_path / "ck" / "step_4")
    with pytest.warns(UserWarning), pytest.raises(sw.CheckpointError, match="no checkpoint under"):
        sw.Checkpoints(tmp_path / "ck", every_steps=2).resume(_pipe(1)[0])


def test_asynchronous_checkpoints_remove_the_old_one_only_once_the_new_one_is_in_place(tmp_path, monkeypatch):
    pipe, scheduler = _pipe(2)
    checkpoints = sw.Checkpoints(tmp_path / "ck", every_steps=2, keep=1, asynchronous=True)
    _train(pipe, scheduler, checkpoints, range(2))
    checkpoints.wait()
    assert checkpoints.saved_steps() == [2]
    gate, write = threading.Event(), checkpoint_write.write_tensors

    def held(*args, **kwargs):
        gate.wait(30)
        return write(*args, **kwargs)

    monkeypatch.setattr(checkpoint_write, "write_tensors", held)
    _train(pipe, scheduler, checkpoints, range(2, 5))  # step 4's save is held: training went on past it
    older = sw.load(tmp_path / "ck" / "step_2")  # the old one is still there, whole
    assert older._executor.state.iteration == 2 and checkpoints.saved_steps() == [2]
    gate.set()
    checkpoints.wait()
    assert checkpoints.saved_steps() == [4] and sw.load(tmp_path / "ck" / "step_4")._executor.state.iteration == 4


def test_every_seconds_saves_when_the_time_is_up(tmp_path):
    pipe, scheduler = _pipe(1)
    checkpoints = sw.Checkpoints(tmp_path, every_seconds=0.2)
    checkpoints.resume(pipe)
    assert _train(pipe, scheduler, checkpoints, range(1)) == [False]
    time.sleep(0.25)
    assert _train(pipe, scheduler, checkpoints, range(1, 3)) == [True, False]
    assert checkpoints.saved_steps() == [2]


@pytest.mark.parametrize("kwargs", [{}, {"every_steps": 0}, {"every_steps": 1.5}, {"every_seconds": -1},
                                    {"every_steps": 2, "keep": 0}, {"every_seconds": True}])
def test_settings_that_would_never_save_or_keep_nothing_are_refused(kwargs):
    with pytest.raises(sw.OptionError, match="sw.Checkpoints"):
        sw.Checkpoints("ck", **kwargs)


# ---- under torchrun ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> tuple[dict, list[tuple[str, str]]]:
    """The example's run in this process, on one device, never interrupted: its final state and losses."""
    where = tmp_path_factory.mktemp("uninterrupted")
    state, losses = run_uninterrupted(["--checkpoints", str(where / "ck"), *_schedule()], where / "final.pt")
    assert [int(step) for step, _ in losses] == list(range(STEPS))
    return state, losses


def _schedule() -> list[str]:
    return ["--steps", str(STEPS), "--every", str(EVERY), "--keep", str(KEEP), "--timeout", "10"]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _environment() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_", "MASTER_",
                                                                     "TORCHELASTIC", "GROUP_"))}
    # torchrun >= 2.5 hands its store to the workers; a same-size restart then reads the last
    # attempt's addresses (pytorch/pytorch#135712): the README's recipe turns that off.
    return {**env, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}


@contextlib.contextmanager
def _jobs(tag: str):
    """Start commands (each in a session of its own, output to a log); kill whatever is left at the end:
    the agents, and the workers they started (found by `tag`, a path only this test's commands name)."""
    started: list[subprocess.Popen] = []

    def start(command: list[str], log: Path) -> subprocess.Popen:
        with open(log, "w") as out:
            process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=_environment(),
                                       start_new_session=True, cwd=EXAMPLE.parent.parent)
        started.append(process)
        return process

    try:
        yield start
    finally:
        for process in started:
            if process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                process.wait(timeout=10)
        for pid in pids_naming(tag):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def _finish(process: subprocess.Popen, deadline: float) -> int | None:
    """The command's exit status; None if it still runs at `deadline` (killed at the end of `_jobs`)."""
    try:
        return process.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        return None


def _ended(job: tuple[int | None, str]) -> str:
    """What a job printed, once it is known to have ended in time."""
    code, text = job
    assert code is not None, f"torchrun still running after {DEADLINE_S:g} s:\n{text[-4000:]}"
    return text


def _check_result(text: str, final: Path, uninterrupted, restarted_world: int) -> None:
    """The restarted run resumed at step 4 and ended where the uninterrupted run did."""
    want_state, want_losses = uninterrupted
    assert "world 2: starting at step 0" in text, text[-4000:]
    assert f"world {restarted_world}: starting at step 4" in text, text[-4000:]
    printed = LINE.findall(text)
    assert [s for s, _, w in printed] == [str(s) for s in [*range(DIE_AT), *range(4, STEPS)]], printed
    assert [w for *_, w in printed] == ["2"] * DIE_AT + [str(restarted_world)] * (STEPS - 4), printed
    losses = dict(want_losses)
    for step, loss, _ in printed:  # printed to 6 decimals: fp32 rounding stays below
        assert abs(float(loss) - float(losses[step])) <= 2e-6, (step, loss, losses[step])
    got = torch.load(final)
    assert got.keys() == want_state.keys()
    for name, tensor in want_state.items():
        torch.testing.assert_close(got[name], tensor, rtol=1e-5, atol=1e-6, msg=name)


def _start_two_machines(run, where: Path) -> tuple[subprocess.Popen, subprocess.Popen]:
    """Two agents in one elastic job: the survivor (machine A) and the machine whose rank dies at
    DIE_AT taking its agent along (machine B)."""
    # A lost node is dead after 2 missed 1 s heartbeats; the survivor then waits last_call_timeout for
    # others before it goes on alone (the same wait lets the second agent join at the start).
    port, conf = _free_port(), ("join_timeout=30,last_call_timeout=5,close_timeout=5,"
                                "keep_alive_interval=1,keep_alive_max_attempt=2")
    common = [TORCHRUN, "--nnodes=1:2", "--nproc-per-node=1", "--rdzv-backend=c10d",
              f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id=elastic-{port}", "--max-restarts=1",
              "--monitor-interval=0.1"]
    script = [str(EXAMPLE), "--checkpoints", str(where / "ck"), *_schedule()]
    # Machine A hosts the rendezvous store, and its address sorts first: it is rank 0.
    survivor = run([*common, "--local-addr=127.0.0.1", f"--rdzv-conf=is_host=1,{conf}", *script,
                    "--final", str(where / "final.pt")], where / "a.log")
    lost = run([*common, "--local-addr=localhost", f"--rdzv-conf=is_host=0,{conf}", *script,
                "--die-at", str(DIE_AT), "--lose-machine"], where / "b.log")
    return survivor, lost


def _one_agent_two_workers(where: Path) -> list[str]:
    """One agent, two workers; rank 1 exits at DIE_AT and the agent restarts both at the same size."""
    return [TORCHRUN, "--standalone", "--nproc-per-node=2", "--max-restarts=1", "--monitor-interval=0.1",
            str(EXAMPLE), "--checkpoints", str(where / "ck"), *_schedule(), "--final", str(where / "final.pt"),
            "--die-at", str(DIE_AT), "--die-rank", "1"]


@pytest.fixture(scope="module")
def torchrun_jobs(tmp_path_factory) -> tuple[Path, dict[str, tuple[int | None, str]]]:
    """Both torchrun jobs, side by side: the same-size one starts once machine B is gone, while the
    survivor mostly waits (2 s of missed heartbeats, 5 s of last call), so the two take little more
    than the lost machine's job alone. Their folder, and per log (a, b, job) the exit status and text."""
    if TORCHRUN is None:
        pytest.skip("torchrun is not installed")
    root = tmp_path_factory.mktemp("torchrun")
    logs = {"a": root / "machines" / "a.log", "b": root / "machines" / "b.log",
            "job": root / "same-size" / "job.log"}
    for log in logs.values():
        log.parent.mkdir(exist_ok=True)
    with _jobs(str(root)) as run:
        deadline = time.monotonic() + DEADLINE_S
        survivor, lost = _start_two_machines(run, root / "machines")
        codes = {"b": _finish(lost, deadline)}
        job = run(_one_agent_two_workers(root / "same-size"), logs["job"])
        codes["a"] = _finish(survivor, deadline)
        codes["job"] = _finish(job, time.monotonic() + DEADLINE_S)
    return root, {name: (code, logs[name].read_text()) for name, code in codes.items()}


def test_a_lost_machine_the_survivor_resumes_alone_from_the_checkpoint_both_saved(torchrun_jobs, uninterrupted):
    root, jobs = torchrun_jobs
    where = root / "machines"
    text, lost_text = _ended(jobs["a"]), _ended(jobs["b"])
    assert jobs["a"][0] == 0, text[-4000:]
    assert jobs["b"][0] == -signal.SIGKILL and f"rank 1 dies at step {DIE_AT}" in lost_text, lost_text[-4000:]
    assert "restored a checkpoint of 2 device(s) onto 1" in text, text[-4000:]
    _check_result(text, where / "final.pt", uninterrupted, restarted_world=1)
    assert sorted(p.name for p in (where / "ck").glob("step_*")) == ["step_4", "step_6", "step_8"]
    before_failure = sw.load(where / "ck" / "step_4")  # the one the survivor resumed from, still whole
    assert before_failure._executor.state.iteration == 4 and len(before_failure.plan.devices) == 2


def test_a_dead_rank_restarts_both_at_the_same_size_from_the_checkpoint(torchrun_jobs, uninterrupted):
    root, jobs = torchrun_jobs
    text = _ended(jobs["job"])
    assert jobs["job"][0] == 0, text[-4000:]
    assert text.count(f"rank 1 dies at step {DIE_AT}") == 1, text[-4000:]  # once: the restart did not die again
    _check_result(text, root / "same-size" / "final.pt", uninterrupted, restarted_world=2)
