"""One process per device: two gloo ranks train like eager training; a dead peer is an error.

Each test spawns two processes that join a process group through a file store (as torchrun's
processes do) and run the same user code as in one process: `sw.compile` sees the process
group, keeps this rank's stages and program, and sends through torch.distributed. The parent
compares what the ranks saved with eager training.

Spawning a pair of processes costs seconds, so one pair trains the whole matrix of cases (every
schedule with swapping forced on and off, on the tied GPT and on Hugging Face GPT-2, and an MLP),
one after another, and each case is then checked as its own test.
"""

from __future__ import annotations

import functools
import itertools
import os
import time
from pathlib import Path

import pytest
import torch

import stagewise as sw
from stagewise.runtime.launch import distributed_context
from stagewise.runtime.links import directed_links, misordered_links
from tests.harness.rank_problems import compile_case, problem
from tests.harness.ranks import RANKS, SPAWN_LIMIT_S, case_results, join, run_cases, save_result, spawn
from tests.harness.two_bw import newest_state, two_bw_reference
from tests.reference import ATOL, RTOL, assert_state_equal, eager_train, pipeline_train

# ---- the cases (their problems: tests/harness/rank_problems.py) ----------------------------------
SCHEDULES = ("gpipe", "1f1b", "interleaved", "varuna", "harmony-pp", "harmony-dp")
# (problem, schedule, mode), a covering array (test_the_cases_cover_every_pair_the_matrix_names): every
# schedule with swapping forced on and off, with and without clipping, on the tied GPT (tied embedding
# and head on the first and last stage, on different ranks except under harmony-dp, where each rank
# holds every pack and the replicas all-reduce) and on HF GPT-2 (tied too, its own loss, dict inputs);
# state and stashes swapped ("all") and the optimizer on the host under several schedules; and the MLP
# (no shared tensors, SGD, loss_fn), once with rank 1 idle. The modes: MODES in tests/harness/rank_problems.py.
EAGER_CASES = (
    [("mlp", "gpipe", "off"), ("mlp", "1f1b", "one-stage")]
    + [("tied-gpt", "gpipe", "on"), ("tied-gpt", "1f1b", "on"), ("tied-gpt", "interleaved", "off"),
       ("tied-gpt", "varuna", "off"), ("tied-gpt", "harmony-pp", "off"), ("tied-gpt", "harmony-dp", "on")]
    + [("tied-gpt", "1f1b", "all"), ("tied-gpt", "harmony-pp", "all"),
       ("tied-gpt", "1f1b", "host"), ("tied-gpt", "harmony-pp", "host"), ("tied-gpt", "zb-h1", "off"),
       ("tied-gpt", "zb-v", "off")]
    + [("hf-gpt2", "1f1b", "off"), ("hf-gpt2", "interleaved", "on"), ("hf-gpt2", "varuna", "on"),
       ("hf-gpt2", "harmony-pp", "on"), ("hf-gpt2", "harmony-dp", "off"), ("hf-gpt2", "gpipe", "all")]
)
# PipeDream-2BW does not train like eager: checked against its update rule (tests/test_two_bw.py). Last, so
# that a failure there (which ends the matrix on its rank) costs no other case.
TWO_BW_CASE = ("mlp", "2bw", "async")
CASES = [*EAGER_CASES, TWO_BW_CASE]
MATRIX_LIMIT_S = 150.0  # the whole matrix on one pair of ranks (about 20 s on an idle 2-core machine)


@functools.cache
def _eager(name: str, mode: str) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    """Eager losses and trained state; one run serves every schedule of a problem. On one thread:
    on ops this small a second one only waits, and on a busy machine it made eager training 50x slower."""
    model, batches, options = problem(name, mode)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return eager_train(model, batches, **options), model.state_dict()
    finally:
        torch.set_num_threads(threads)


# ---- what each rank runs --------------------------------------------------------------------
def _train_cases(rank: int, init_file: str, out: str, cases) -> None:
    run_cases(rank, init_file, out, cases, functools.partial(_train_case, rank))


def _train_case(rank: int, case) -> dict:
    pipe, batches = compile_case(*case)
    pipe.timeout_s = 20.0
    devices = {w.stage.device for w in pipe._workers}
    # every rank makes its scheduler over pipe.optimizer, a rank without a trainable stage too
    scheduler = torch.optim.lr_scheduler.LambdaLR(pipe.optimizer, lambda step: 1.0)  # eager keeps its lr
    losses = pipeline_train(pipe, batches[:1])
    scheduler.step()
    losses += pipeline_train(pipe, batches[1:])
    state = {k: v.clone() for k, v in pipe.state_dict().items()}  # gathered from every rank
    optimizer = pipe.optimizer.state_dict()  # gathered too
    return {"context": tuple(distributed_context()), "devices": devices, "losses": losses, "state": state,
            "stats": pipe.stats[rank], "lrs": [g["lr"] for g in pipe.optimizer.param_groups],
            "optimizer_names": sorted(optimizer["state"]), "newest": newest_state(pipe)}  # this rank's stages'


FAILURE_TIMEOUT_S = {"exits": 2.0, "silent": 2.0, "fails-locally": 10.0}


def _failure(rank: int, init_file: str, out: str, how: str) -> None:
    """One rank goes wrong; each rank that steps saves what its step raised and how long it took.

    exits: rank 1 quits after joining, as a crash would. silent: rank 1 stays alive but never
    steps. fails-locally: rank 0's forward of microbatch 1 raises while its receive thread waits.
    """
    join(init_file, rank, 30.0)
    model, batches, options = problem("mlp")
    inputs, target = batches[0]
    # analytic costs, as compile_case's: measured ones could partition differently on the two ranks
    pipe = sw.compile(model, RANKS, inputs, example_target=target, cost="analytic", **options)
    pipe.timeout_s = FAILURE_TIMEOUT_S[how]
    if rank == 1 and how in ("exits", "silent"):
        _idle_until(Path(out) / "rank0.pkl" if how == "silent" else None)
        os._exit(0)  # no destroy_process_group: a crashed peer says no goodbye either
    if rank == 0 and how == "fails-locally":
        _break_forward(pipe._workers[0], microbatch=1)
    start = time.monotonic()
    try:
        pipe.step(*inputs, target=target)
        result = {"error": None}
    except Exception as error:  # noqa: BLE001 - the parent checks what it was
        result = {"error": type(error).__name__, "message": str(error)}
    result["seconds"] = time.monotonic() - start
    save_result(Path(out) / f"rank{rank}.pkl", result)
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
@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> list[dict]:
    """Every case of CASES trained by one pair of ranks: per rank, case -> what it saved."""
    results = spawn(_train_cases, tmp_path_factory.mktemp("cases"), CASES, limit_s=MATRIX_LIMIT_S,
                     fail_on_hang=False)  # a hang fails the case it stopped at, and the ones after it
    return [result or {} for result in results]


@pytest.mark.parametrize("case", EAGER_CASES, ids="-".join)
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
        _assert_time_split(stats, idle, swapped=stats["swap_in_bytes"] > 0)
    assert all(torch.equal(a, b) for a, b in zip(results[0]["losses"], results[1]["losses"], strict=True))
    assert_state_equal(results[0]["state"], state)
    assert_state_equal(results[1]["state"], results[0]["state"])
    assert results[0]["lrs"] == results[1]["lrs"] and results[0]["optimizer_names"] == results[1]["optimizer_names"]


def test_two_ranks_train_2bw_by_the_papers_update_rule(trained):
    """schedule="2bw" one process per device, clipped (the global norm all-reduced between the ranks): losses,
    the version the next step computes with (the gathered state_dict) and each rank's newest version equal
    the rule's in plain PyTorch."""
    name, _, mode = TWO_BW_CASE
    results = case_results(trained, TWO_BW_CASE, MATRIX_LIMIT_S)
    model, batches, options = problem(name, mode)
    want, used, newest = two_bw_reference(model, batches, options["optimizer"], options["loss_fn"],
                                          options["clip_grad_norm"], microbatches=options["microbatches"])
    for rank, result in enumerate(results):
        assert result["devices"] == {rank}
        torch.testing.assert_close(torch.stack(result["losses"]), torch.stack(want), rtol=RTOL, atol=ATOL)
        assert_state_equal(result["state"], used.state_dict())
    newest_got = {n: t for result in results for n, t in result["newest"].items()}
    assert set(newest_got) == {n for n, p in newest.named_parameters() if p.requires_grad}
    assert_state_equal(newest_got, {n: t for n, t in newest.state_dict().items() if n in newest_got})
    # the test can fail: from the third step on, 2BW's losses are not synchronous SGD's
    eager_losses, _ = _eager(name, mode)
    assert not torch.allclose(results[0]["losses"][2], eager_losses[2], rtol=RTOL, atol=ATOL)


def _assert_time_split(stats: dict, idle: bool, swapped: bool) -> None:
    """The rank's last step in its stats row: its compute thread's parts add up to the step, the
    waits on the other rank are waiting (not compute), and swapping shows as swap time."""
    if idle:
        assert not stats["compute_s"], stats
        return
    parts = sum(stats[name] for name in ("compute_s", "waiting_s", "dispatch_s", "inline_s", "idle_s"))
    assert parts == pytest.approx(stats["step_s"], rel=1e-9), stats
    assert stats["compute_s"] > 0 and stats["dispatch_s"] >= 0 and stats["waiting_s"] >= 0, stats
    if stats["p2p_bytes"] > 0:  # it received from the other rank: waited on the network for it
        assert stats["waiting_s"] > 0, stats
    assert (stats["swap_in_s"] + stats["swap_out_s"] > 0) == swapped, stats


def test_the_cases_cover_every_pair_the_matrix_names():
    """Every pair below is some case's: each schedule with swapping on and off, clipped and not (the
    problems clip in every mode but "on"), on the tied GPT and on GPT-2; each mode on the problems
    that take it; state and stashes swapped, and the optimizer on the host, under several schedules."""
    pairs = {("problem", "schedule"): set(itertools.product(("tied-gpt", "hf-gpt2"), SCHEDULES)),
             ("schedule", "mode"): set(itertools.product(SCHEDULES, ("on", "off"))) | {("1f1b", "one-stage")}
             | set(itertools.product(("gpipe", "1f1b", "harmony-pp"), ("all",)))
             | set(itertools.product(("1f1b", "harmony-pp"), ("host",))),
             ("problem", "mode"): set(itertools.product(("tied-gpt",), ("on", "off", "all", "host")))
             | set(itertools.product(("hf-gpt2",), ("on", "off", "all"))) | {("mlp", "off"), ("mlp", "one-stage")},
             ("schedule", "clipped"): set(itertools.product(SCHEDULES, (True, False))),
             ("problem", "clipped"): set(itertools.product(("tied-gpt", "hf-gpt2"), (True, False)))}
    rows = [{"problem": name, "schedule": schedule, "mode": mode,
             "clipped": "clip_grad_norm" in problem(name, mode)[2]} for name, schedule, mode in CASES]
    for (a, b), wanted in pairs.items():
        missing = wanted - {(row[a], row[b]) for row in rows}
        assert not missing, f"no case for ({a}, {b}) in {sorted(missing)}"


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1", "interleaved", "zb-v", "varuna"])
def test_every_link_sends_in_the_order_its_receiver_expects(schedule):
    """NCCL pairs sends with receives by order, not tag: the transport refuses plans where they differ. ZB-V's
    V crosses dev0 -> dev1 twice (stage 0's activations down, stage 3's gradients back) in orders that differ:
    refused under NCCL (runtime/links.py), it runs under gloo and in one process, which match by tag."""
    model, batches, options = problem("tied-gpt")
    options.update(schedule=schedule, microbatches=4)
    inputs, target = batches[0]
    pipe = sw.compile(model, 2 if schedule in ("interleaved", "zb-v") else 3, inputs, example_target=target,
                      cost="analytic", **options)
    assert directed_links(pipe.plan) and misordered_links(pipe.plan) == ([(0, 1)] if schedule == "zb-v" else [])


@pytest.mark.parametrize("how", ["exits", "silent"])
def test_dead_or_silent_peer_is_a_peer_error_not_a_hang(tmp_path, how):
    rank0, _ = spawn(_failure, tmp_path, how)
    timeout = FAILURE_TIMEOUT_S[how]
    assert rank0["error"] == "PeerError", rank0
    assert "rank 1" in rank0["message"] and "dev0" in rank0["message"]
    assert rank0["seconds"] < timeout + 3.0
    if how == "silent":
        assert rank0["seconds"] >= timeout and "waited" in rank0["message"]


def test_local_failure_stops_this_rank_at_once_and_its_peer_with_a_step_failed_error(tmp_path):
    """Rank 0's receive thread aborts instead of waiting out the timeout; rank 1 learns of it too
    (the step failed on rank 0: StepFailedError, tests/test_distributed_faults.py)."""
    rank0, rank1 = spawn(_failure, tmp_path, "fails-locally")
    assert rank0["error"] == "RuntimeError" and "on purpose" in rank0["message"], rank0
    assert rank0["seconds"] < 3.0 < FAILURE_TIMEOUT_S["fails-locally"]
    assert rank1["error"] == "StepFailedError" and "rank 0" in rank1["message"], rank1
    assert rank1["seconds"] < FAILURE_TIMEOUT_S["fails-locally"] + 3.0


def test_the_same_script_runs_under_python_and_torchrun(monkeypatch):
    """examples/train_anywhere.py: in-process, then under torchrun; every rank prints the same losses.
    The in-process run is the script run as __main__ in this process (a fresh interpreter would
    spend 4 CPU-seconds importing what this one has)."""
    import contextlib
    import io
    import runpy
    import subprocess
    import sys

    from transformers.utils import logging as hf_logging

    script = str(Path(__file__).resolve().parent.parent / "examples" / "train_anywhere.py")
    launched_by = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    env = {k: v for k, v in os.environ.items() if k not in launched_by}
    for name in launched_by:  # the script alone: not a rank of a job that launched this process
        monkeypatch.delenv(name, raising=False)
    alone, verbosity = io.StringIO(), hf_logging.get_verbosity()
    with contextlib.redirect_stdout(alone), torch.random.fork_rng():
        runpy.run_path(script, run_name="__main__")
    hf_logging.set_verbosity(verbosity)  # the script quiets transformers; the other tests keep its warnings
    ranked = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", script],
        capture_output=True, text=True, timeout=180, env=env,
    )
    assert ranked.returncode == 0, ranked.stderr[-4000:]  # the ranks' own errors, not only the exit status
    import re

    pattern = r"rank (\S) step (\d) loss ([0-9.]+)"  # torchrun may interleave the ranks' lines
    want = [loss for _, _, loss in re.findall(pattern, alone.getvalue())]
    assert len(want) == 3
    printed = re.findall(pattern, ranked.stdout)
    for rank in ("0", "1"):
        got = [loss for r, _, loss in sorted(printed) if r == rank]
        assert got == want, (rank, ranked.stdout, ranked.stderr[-2000:])
