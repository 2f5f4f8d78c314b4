"""One process per device: two gloo ranks train like eager training; a dead peer is an error.

Each test spawns two processes that join a process group through a file store (as torchrun's
processes do) and run the same user code as in one process: `sw.compile` sees the process
group, keeps this rank's stages and program, and sends through torch.distributed. The parent
compares what the ranks saved with eager training.

Spawning a pair of processes costs seconds, so one pair trains the whole matrix of cases (every
schedule with swapping forced on and off on the tied GPT, several on Hugging Face GPT-2, and an
MLP), one after another, and each case is then checked as its own test.
"""

from __future__ import annotations

import datetime
import functools
import os
import pickle
import time
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

import stagewise as sw
from stagewise.runtime.launch import distributed_context
from stagewise.runtime.links import directed_links, misordered_links
from tests.models.gpt import TinyGPT, lm_loss
from tests.models.mlp import mlp
from tests.reference import ADAMW, ATOL, RTOL, SGD, assert_state_equal, eager_train, pipeline_train

RANKS = 2
STEPS = 3
SPAWN_LIMIT_S = 60.0  # a child that outlives this is killed and the test fails (never a hung suite)


# ---- the problems both ranks and the parent build alike ---------------------------------------
SCHEDULES = ("gpipe", "1f1b", "interleaved", "varuna", "harmony-pp", "harmony-dp")
# (problem, schedule, mode): every schedule with swapping forced on and off on the tied GPT (tied
# embedding and head on the first and last stage, on different ranks except under harmony-dp, where
# each rank holds every pack and the replicas all-reduce), every schedule but GPipe once on HF GPT-2,
# and the MLP (no shared tensors, SGD, loss_fn). Modes: "off" and "on" (swap=), "all" (swap="all":
# state and stashed activations), "host" (optimizer_on_host=True). Every mode but "on" trains with
# gradient clipping (the global-norm all-reduce, every update deferred); "on" keeps the jit-update
# path, where packs without a tied weight update right after their last backward. "one-stage"
# (stages=1) leaves rank 1 without a stage: it steps, saves and loads with nothing to run.
MODES = {"off": {"swap": "off"}, "on": {"swap": "on"}, "all": {"swap": "all"},
         "host": {"swap": "off", "optimizer_on_host": True}, "one-stage": {"swap": "off", "stages": 1}}
CASES = (
    [("mlp", "gpipe", "off"), ("mlp", "1f1b", "one-stage")]
    + [("tied-gpt", schedule, mode) for schedule in SCHEDULES for mode in ("on", "off")]
    + [("tied-gpt", "gpipe", "all"), ("tied-gpt", "1f1b", "all"), ("tied-gpt", "harmony-pp", "all"),
       ("tied-gpt", "1f1b", "host"), ("tied-gpt", "harmony-pp", "host")]
    + [("hf-gpt2", "1f1b", "off"), ("hf-gpt2", "interleaved", "on"), ("hf-gpt2", "varuna", "on"),
       ("hf-gpt2", "harmony-pp", "on"), ("hf-gpt2", "harmony-dp", "off"), ("hf-gpt2", "gpipe", "all")]
)
MATRIX_LIMIT_S = 150.0  # the whole matrix on one pair of ranks (about 20 s on an idle 2-core machine)


def _problem(name: str, mode: str = "off"):
    """(model, batches, options for compile and eager_train) from seed 0, identical in every process."""
    torch.manual_seed(0)
    if name == "mlp":
        batches = [((torch.randn(8, 8),), torch.randint(0, 5, (8,))) for _ in range(STEPS)]
        return mlp(), batches, {"loss_fn": F.cross_entropy, "optimizer": SGD, "microbatches": 2}
    clip = {"clip_grad_norm": 0.5 if name == "tied-gpt" else 1.0} if mode != "on" else {}
    if name == "hf-gpt2":
        from tests.hf import gpt2, lm_batches  # here: importing transformers costs every spawned rank 2 s

        return gpt2(), lm_batches(STEPS), {"optimizer": ADAMW, "microbatches": 2, **clip}
    model = TinyGPT()
    batches = []
    for _ in range(STEPS):
        ids = torch.randint(0, 64, (8, 9))
        batches.append(((ids[:, :-1],), ids[:, 1:]))
    return model, batches, {"loss_fn": lm_loss, "optimizer": ADAMW, "microbatches": 4, **clip}


def _compile(name: str, schedule: str, mode: str):
    """With analytic costs: measured ones differ between the ranks, which could partition differently
    (a PlanError by design); these tests are about the runtime, not the planner."""
    model, batches, options = _problem(name, mode)
    inputs, target = batches[0]
    if target is not None:
        options["example_target"] = target
    return sw.compile(model, RANKS, inputs, schedule=schedule, cost="analytic", **MODES[mode], **options), batches


@functools.cache
def _eager(name: str, mode: str) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    """Eager losses and trained state; one run serves every schedule of a problem. On one thread:
    on ops this small a second one only waits, and on a busy machine it made eager training 50x slower."""
    model, batches, options = _problem(name, mode)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return eager_train(model, batches, **options), model.state_dict()
    finally:
        torch.set_num_threads(threads)


def _join(init_file: str, rank: int, timeout_s: float) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=RANKS,
                            timeout=datetime.timedelta(seconds=timeout_s))


def _save(path: Path, result) -> None:
    """Written beside and renamed into place: a rank killed mid-write leaves its previous save."""
    partial = path.with_suffix(".partial")
    partial.write_bytes(pickle.dumps(result))
    partial.replace(path)


def run_cases(rank: int, init_file: str, out: str, cases, run_case) -> None:
    """On one rank: join, then `run_case(case)` for every case in turn, saving the results after each;
    the first failure (saved as its traceback) ends the matrix on this rank (the peer then fails on a
    PeerError: later collectives could not be matched)."""
    _join(init_file, rank, 30.0)
    torch.set_num_threads(1)  # two ranks share the machine's cores
    path = Path(out) / f"rank{rank}.pkl"
    results: dict = {}
    for case in cases:
        try:
            results[case] = run_case(case)
        except Exception:  # noqa: BLE001 - the parent shows it
            results[case] = {"error": traceback.format_exc()}
            _save(path, results)
            os._exit(0)  # the process group may be mid-collective; do not wait on it at exit
        _save(path, results)
    dist.destroy_process_group()


def case_results(per_rank: list[dict], case, limit_s: float) -> list[dict]:
    """Every rank's result of `case` from `run_cases`, each rank's own failure shown."""
    results = [results.get(case) for results in per_rank]
    for rank, result in enumerate(results):
        failed = [f"{c}: {r['error']}" for c, r in per_rank[rank].items() if "error" in r]
        assert result is not None, f"rank {rank} did not finish {case}; " + (
            "\n".join(failed) or f"it hung, or the matrix took over {limit_s:.0f} s")
        assert "error" not in result, f"rank {rank} failed:\n{result['error']}"
    return results


# ---- what each rank runs --------------------------------------------------------------------
def _train_cases(rank: int, init_file: str, out: str, cases) -> None:
    run_cases(rank, init_file, out, cases, functools.partial(_train_case, rank))


def _train_case(rank: int, case) -> dict:
    pipe, batches = _compile(*case)
    pipe.timeout_s = 20.0
    devices = {w.stage.device for w in pipe.workers}
    # every rank makes its scheduler over pipe.optimizer, a rank without a trainable stage too
    scheduler = torch.optim.lr_scheduler.LambdaLR(pipe.optimizer, lambda step: 1.0)  # eager keeps its lr
    losses = pipeline_train(pipe, batches[:1])
    scheduler.step()
    losses += pipeline_train(pipe, batches[1:])
    state = {k: v.clone() for k, v in pipe.state_dict().items()}  # gathered from every rank
    optimizer = pipe.optimizer.state_dict()  # gathered too
    return {"context": tuple(distributed_context()), "devices": devices, "losses": losses, "state": state,
            "stats": pipe.stats[rank], "lrs": [g["lr"] for g in pipe.optimizer.param_groups],
            "optimizer_names": sorted(optimizer["state"])}


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
def _spawn(fn, tmp_path: Path, *args, limit_s: float = SPAWN_LIMIT_S, fail_on_hang: bool = True,
           ranks: int = RANKS) -> list[dict]:
    """Run `fn(rank, init_file, out, *args)` on `ranks` processes; kill them past `limit_s` (and fail,
    unless the caller reads what they saved before that); what each saved in out/rank<r>.pkl."""
    init_file = str(tmp_path / "store")
    context = mp.start_processes(fn, args=(init_file, str(tmp_path), *args), nprocs=ranks, join=False,
                                 start_method="spawn")
    deadline = time.monotonic() + limit_s
    while not context.join(timeout=0.5):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            if fail_on_hang:
                pytest.fail(f"the ranks did not finish within {limit_s:.0f} s (a hang)")
            break
    return [pickle.loads(p.read_bytes()) if p.exists() else None
            for p in (tmp_path / f"rank{r}.pkl" for r in range(ranks))]


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> list[dict]:
    """Every case of CASES trained by one pair of ranks: per rank, case -> what it saved."""
    results = _spawn(_train_cases, tmp_path_factory.mktemp("cases"), CASES, limit_s=MATRIX_LIMIT_S,
                     fail_on_hang=False)  # a hang fails the case it stopped at, and the ones after it
    return [result or {} for result in results]


@pytest.mark.parametrize("case", CASES, ids="-".join)
def test_two_ranks_train_like_eager(trained, case):
    """Losses and parameters equal eager training's on both ranks; each rank ran only its own
    stages, and moved state to host memory exactly when its mode asks for it."""
    name, schedule, mode = case
    results = case_results(trained, case, MATRIX_LIMIT_S)
    want, state = _eager(name, mode)
    for rank, result in enumerate(results):
        assert result["context"] == (rank, RANKS, rank)
        idle = mode == "one-stage" and rank > 0
        assert result["devices"] == (set() if idle else {rank})  # this rank runs only its own stages
        torch.testing.assert_close(torch.stack(result["losses"]), torch.stack(want), rtol=RTOL, atol=ATOL)
        stats = result["stats"]
        assert (stats["p2p_bytes"] > 0) == (mode != "one-stage")
        assert (stats["swap_in_bytes"] > 0) == (stats["swap_out_bytes"] > 0) == (mode not in ("off", "one-stage")), stats
        if mode == "host":
            assert stats["optimizer_bytes"] == 0, stats  # the optimizer state never reaches the device
    assert all(torch.equal(a, b) for a, b in zip(results[0]["losses"], results[1]["losses"], strict=True))
    assert_state_equal(results[0]["state"], state)
    assert_state_equal(results[1]["state"], results[0]["state"])
    assert results[0]["lrs"] == results[1]["lrs"] and results[0]["optimizer_names"] == results[1]["optimizer_names"]


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


def test_local_failure_stops_this_rank_at_once_and_its_peer_with_a_step_failed_error(tmp_path):
    """Rank 0's receive thread aborts instead of waiting out the timeout; rank 1 learns of it too
    (the step failed on rank 0: StepFailedError, tests/test_distributed_faults.py)."""
    rank0, rank1 = _spawn(_failure, tmp_path, "fails-locally")
    assert rank0["error"] == "RuntimeError" and "on purpose" in rank0["message"], rank0
    assert rank0["seconds"] < 3.0 < FAILURE_TIMEOUT_S["fails-locally"]
    assert rank1["error"] == "StepFailedError" and "rank 0" in rank1["message"], rank1
    assert rank1["seconds"] < FAILURE_TIMEOUT_S["fails-locally"] + 3.0


def test_the_same_script_runs_under_python_and_torchrun():
    """examples/train_anywhere.py: in-process, then under torchrun; every rank prints the same losses."""
    import subprocess
    import sys

    script = str(Path(__file__).resolve().parent.parent / "examples" / "train_anywhere.py")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    alone = subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=120, env=env)
    assert alone.returncode == 0, alone.stderr[-4000:]
    ranked = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", script],
        capture_output=True, text=True, timeout=180, env=env,
    )
    assert ranked.returncode == 0, ranked.stderr[-4000:]  # the ranks' own errors, not only the exit status
    import re

    pattern = r"rank (\S) step (\d) loss ([0-9.]+)"  # torchrun may interleave the ranks' lines
    want = [loss for _, _, loss in re.findall(pattern, alone.stdout)]
    assert len(want) == 3
    printed = re.findall(pattern, ranked.stdout)
    for rank in ("0", "1"):
        got = [loss for r, _, loss in sorted(printed) if r == rank]
        assert got == want, (rank, ranked.stdout, ranked.stderr[-2000:])
