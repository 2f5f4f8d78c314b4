"""One process per device: two gloo ranks train like eager training; a dead peer is an error.

Each test spawns two processes that join a process group through a file store (as torchrun's
processes do) and run the same user code as in one process: `sw.compile` sees the process
group, keeps this rank's stages and program, and sends through torch.distributed. The parent
compares what the ranks saved with eager training.
"""

from __future__ import annotations

import datetime
import os
import pickle
import time
from pathlib import Path

import pytest
import stagewise as sw
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from stagewise.runtime.distributed import directed_links, misordered_links
from stagewise.runtime.launch import distributed_context

from tests.models.gpt import TinyGPT, lm_loss
from tests.models.mlp import mlp
from tests.reference import ADAMW, SGD, assert_state_equal, eager_train

RANKS = 2
STEPS = 3
SPAWN_LIMIT_S = 60.0  # a child that outlives this is killed and the test fails (never a hung suite)


# ---- the problems both ranks and the parent build alike ---------------------------------------
def _problem(name: str):
    """(model, batches, compile options) from seed 0, identical in every process."""
    torch.manual_seed(0)
    if name == "mlp":
        batches = [((torch.randn(8, 8),), torch.randint(0, 5, (8,))) for _ in range(STEPS)]
        return mlp(), batches, {"loss_fn": F.cross_entropy, "optimizer": SGD, "microbatches": 2}
    model = TinyGPT()
    batches = []
    for _ in range(STEPS):
        ids = torch.randint(0, 64, (8, 9))
        batches.append(((ids[:, :-1],), ids[:, 1:]))
    options = {"loss_fn": lm_loss, "optimizer": ADAMW, "microbatches": 2, "clip_grad_norm": 0.5}
    if name == "interleaved-gpt":  # two stages per rank: local and remote messages, groups over stages
        options.update(schedule="interleaved", optimizer=SGD, microbatches=4)
    return model, batches, options


def _join(init_file: str, rank: int, timeout_s: float) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=RANKS,
                            timeout=datetime.timedelta(seconds=timeout_s))


def _save(path: Path, result) -> None:
    path.write_bytes(pickle.dumps(result))


# ---- what each rank runs --------------------------------------------------------------------
def _train(rank: int, init_file: str, out: str, name: str) -> None:
    _join(init_file, rank, 20.0)
    context = distributed_context()
    model, batches, options = _problem(name)
    inputs, target = batches[0]
    pipe = sw.compile(model, RANKS, inputs, example_target=target, **options)
    pipe.timeout_s = 20.0
    assert {w.stage.device for w in pipe.workers} == {rank}  # this rank runs only its own stages
    losses = [pipe.step(*inputs, target=target) for inputs, target in batches]
    state = {k: v.clone() for k, v in pipe.state_dict().items()}  # gathered from every rank
    _save(Path(out) / f"rank{rank}.pkl", {"context": tuple(context), "losses": losses, "state": state,
                                          "p2p_bytes": pipe.pools[rank].p2p_bytes})
    dist.destroy_process_group()


FAILURE_TIMEOUT_S = {"exits": 2.0, "silent": 2.0, "fails-locally": 10.0}


def _failure(rank: int, init_file: str, out: str, how: str) -> None:
    """One rank goes wrong; each rank that steps saves what its step raised and how long it took.

    exits: rank 1 quits after joining, as a crash would. silent: rank 1 stays alive but never
    steps. fails-locally: rank 0's forward of microbatch 1 raises while its receive thread waits.
    """
    _join(init_file, rank, 30.0)
    model, batches, options = _problem("mlp")
    inputs, target = batches[0]
    pipe = sw.compile(model, RANKS, inputs, example_target=target, **options)
    pipe.timeout_s = FAILURE_TIMEOUT_S[how]
    if rank == 1 and how in ("exits", "silent"):
        _idle_until(Path(out) / "rank0.pkl" if how == "silent" else None)
        os._exit(0)  # no destroy_process_group: a crashed peer says no goodbye either
    if rank == 0 and how == "fails-locally":
        _break_forward(pipe.workers[0], microbatch=1)
    start = time.monotonic()
    try:
        pipe.step(*inputs, target=target)
        result = {"error": None}
    except Exception as error:  # noqa: BLE001 - the parent checks what it was
        result = {"error": type(error).__name__, "message": str(error)}
    result["seconds"] = time.monotonic() - start
    _save(Path(out) / f"rank{rank}.pkl", result)
    os._exit(0)  # the process group is broken; do not wait on it at exit


def _idle_until(flag: Path | None) -> None:
    deadline = time.monotonic() + SPAWN_LIMIT_S / 2
    while flag is not None and not flag.exists() and time.monotonic() < deadline:
        time.sleep(0.05)


def _break_forward(worker, microbatch: int) -> None:
    forward = worker.forward

    def failing(mb: int, *args, **kwargs) -> None:
        if mb == microbatch:
            raise RuntimeError("stage 0 failed on purpose")
        forward(mb, *args, **kwargs)

    worker.forward = failing


# ---- the parent ------------------------------------------------------------------------------
def _spawn(fn, tmp_path: Path, *args) -> list[dict]:
    """Run `fn(rank, init_file, out, *args)` on two processes; kill them past SPAWN_LIMIT_S."""
    init_file = str(tmp_path / "store")
    context = mp.start_processes(fn, args=(init_file, str(tmp_path), *args), nprocs=RANKS, join=False,
                                 start_method="spawn")
    deadline = time.monotonic() + SPAWN_LIMIT_S
    while not context.join(timeout=0.5):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail(f"the ranks did not finish within {SPAWN_LIMIT_S:.0f} s (a hang)")
    return [pickle.loads(p.read_bytes()) if p.exists() else None
            for p in (tmp_path / f"rank{r}.pkl" for r in range(RANKS))]


@pytest.mark.parametrize("name", ["mlp", "tied-gpt", "interleaved-gpt"])
def test_two_ranks_train_like_eager(tmp_path, name):
    """MLP: p2p of activations and gradients. Tied GPT with clipping: both kinds of all-reduce.
    Interleaved: two stages per rank, the tied weight's stages 0 and 3 on different ranks."""
    results = _spawn(_train, tmp_path, name)
    model, batches, options = _problem(name)
    options.pop("schedule", None)
    want = eager_train(model, batches, **options)
    for rank, result in enumerate(results):
        assert result["context"] == (rank, RANKS, rank)
        torch.testing.assert_close(torch.stack(result["losses"]), torch.stack(want), rtol=1e-5, atol=1e-6)
        assert result["p2p_bytes"] > 0
    assert all(torch.equal(a, b) for a, b in zip(results[0]["losses"], results[1]["losses"], strict=True))
    assert_state_equal(results[0]["state"], model.state_dict())
    assert_state_equal(results[1]["state"], results[0]["state"])


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved", "varuna"])
def test_every_link_sends_in_the_order_its_receiver_expects(schedule):
    """NCCL pairs sends with receives by order, not tag: the transport refuses plans where they differ."""
    model, batches, options = _problem("tied-gpt")
    options.update(schedule=schedule, microbatches=4)
    inputs, target = batches[0]
    pipe = sw.compile(model, 2 if schedule == "interleaved" else 3, inputs, example_target=target, **options)
    assert directed_links(pipe.plan) and misordered_links(pipe.plan) == []


@pytest.mark.parametrize("how", ["exits", "silent"])
def test_dead_or_silent_peer_is_a_peer_error_not_a_hang(tmp_path, how):
    rank0, _ = _spawn(_failure, tmp_path, how)
    timeout = FAILURE_TIMEOUT_S[how]
    assert rank0["error"] == "PeerError", rank0
    assert "rank 1" in rank0["message"] and "dev0" in rank0["message"]
    assert rank0["seconds"] < timeout + 3.0
    if how == "silent":
        assert rank0["seconds"] >= timeout and "waited" in rank0["message"]


def test_local_failure_stops_this_rank_at_once_and_its_peer_with_a_peer_error(tmp_path):
    """Rank 0's receive thread aborts instead of waiting out the timeout; rank 1 learns of it too."""
    rank0, rank1 = _spawn(_failure, tmp_path, "fails-locally")
    assert rank0["error"] == "RuntimeError" and "on purpose" in rank0["message"], rank0
    assert rank0["seconds"] < 3.0 < FAILURE_TIMEOUT_S["fails-locally"]
    assert rank1["error"] == "PeerError" and "rank 0" in rank1["message"], rank1
    assert rank1["seconds"] < FAILURE_TIMEOUT_S["fails-locally"] + 3.0


def test_the_same_script_runs_under_python_and_torchrun():
    """examples/train_anywhere.py: in-process, then under torchrun; every rank prints the same losses."""
    import subprocess
    import sys

    script = str(Path(__file__).resolve().parent.parent / "examples" / "train_anywhere.py")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    alone = subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=120, env=env, check=True)
    ranked = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", script],
        capture_output=True, text=True, timeout=180, env=env, check=True,
    )
    import re

    pattern = r"rank (\S) step (\d) loss ([0-9.]+)"  # torchrun may interleave the ranks' lines
    want = [loss for _, _, loss in re.findall(pattern, alone.stdout)]
    assert len(want) == 3
    printed = re.findall(pattern, ranked.stdout)
    for rank in ("0", "1"):
        got = [loss for r, _, loss in sorted(printed) if r == rank]
        assert got == want, (rank, ranked.stdout, ranked.stderr[-2000:])
