"""pipe.save under torch.distributed: every rank calls it, rank 0 writes one complete checkpoint.

One pair of gloo ranks (spawned as in tests/test_distributed.py) trains the tied GPT for a few
steps under several plans, saves, loads the checkpoint back under torch.distributed and trains
both pipelines on. The parent then loads each checkpoint in a single process and compares it
with a single-process run of the same training: weights, optimizer state, and the losses of
training on. The same pair also shows the failures: a rank that cannot snapshot its stages, or
a rank 0 that cannot write, fails the save on both ranks and leaves the earlier checkpoint
intact; a save called on rank 0 only is a PeerError within the pipeline's timeout, not a hang.
The same pair runs tests/test_async_save.py's asynchronous save under two ranks (one process-group
start for both files).
"""

from __future__ import annotations

import os
import time
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import stagewise as sw
from stagewise.compiler.checkpoint import write as checkpoint_write
from tests.harness.async_save import check_saved_on_two_ranks, save_on_this_rank
from tests.harness.checkpoints import assert_optimizer_state_equal, optimizer_state
from tests.harness.rank_problems import compile_case
from tests.harness.ranks import join, save_result, spawn
from tests.reference import ATOL, RTOL, assert_state_equal, pipeline_train, token_batches

# (schedule, swap): the tied embedding and head on different ranks with clipping; two stages per
# rank; Harmony's wrap-around packs with weights and optimizer state swapped to host memory.
CASES = (("1f1b", "off"), ("interleaved", "off"), ("harmony-pp", "on"))
SAVED_AFTER = 2  # steps trained before the save (of the problem's 3 batches)
LIMIT_S = 120.0  # the whole script on one pair of ranks (about 15 s on an idle 2-core machine)
TIMEOUT_S = 20.0
ALONE_TIMEOUT_S = 1.0  # the pipeline's timeout for the save called on rank 0 only (waited out in full)


def _more() -> list:
    """The batches both runs train on after the save, alike in every process."""
    state = torch.random.get_rng_state()
    torch.manual_seed(1)
    try:
        return token_batches(2)
    finally:
        torch.random.set_rng_state(state)


def _case_dir(out: str, case: tuple[str, str]) -> Path:
    return Path(out) / "-".join(case)


# ---- what each rank runs --------------------------------------------------------------------
def _save_and_load(rank: int, init_file: str, out: str, cases) -> None:
    join(init_file, rank, 30.0)
    torch.set_num_threads(1)
    path = Path(out) / f"rank{rank}.pkl"
    results = {}
    try:
        pipes = []
        for case in cases:
            pipe, batches = compile_case("tied-gpt", *case)
            pipe.timeout_s = TIMEOUT_S
            pipeline_train(pipe, batches[:SAVED_AFTER])
            directory = _case_dir(out, case)
            pipe.save(directory)
            seen = sorted(p.name for p in directory.iterdir())  # complete the moment save returns
            loaded = sw.load(directory)  # this rank's stages only
            loaded.timeout_s = TIMEOUT_S
            results[case] = {
                "seen": seen,
                "stages": sorted(w.stage.index for w in loaded._workers),
                "all_stages": sorted(s.index for s in pipe.plan.stages),
                "loaded": pipeline_train(loaded, _more()),
                "original": pipeline_train(pipe, _more()),
            }
            pipes.append(pipe)
            save_result(path, results)
        for how in ("write", "snapshot"):
            results[f"failing {how}"] = _failing_save(pipes[0], rank, out, how)
        try:
            results["asynchronous"] = save_on_this_rank(Path(out) / "asynchronous")
        except Exception:  # noqa: BLE001 - its own test shows it
            results["asynchronous"] = {"error": traceback.format_exc()}
        save_result(path, results)
        results["rank 0 alone"] = _save_on_rank_0_only(pipes[0], rank, out)
    except Exception:  # noqa: BLE001 - the parent shows it
        results["error"] = traceback.format_exc()
    save_result(path, results)
    os._exit(0)  # the last case leaves a barrier unmatched on purpose; do not wait on it at exit


def _failing_save(pipe, rank: int, out: str, how: str) -> dict:
    """Save the first case's pipeline again, over its checkpoint, and fail: rank 1 cannot snapshot
    its stages ("snapshot"), or rank 0 cannot write where it is asked to ("write")."""
    directory = _case_dir(out, CASES[0])
    before = {str(p.relative_to(directory)): p.read_bytes() for p in directory.rglob("*") if p.is_file()}
    target = directory
    local_part = checkpoint_write._local_part
    if how == "snapshot" and rank == 1:
        checkpoint_write._local_part = _failing
    if how == "write":
        target = Path(out) / "a-file" / "ck"
        if rank == 0:
            target.parent.write_text("not a directory")
    start = time.monotonic()
    try:
        pipe.save(target)
        error = None
    except Exception as raised:  # noqa: BLE001 - the parent checks what it was
        error = (type(raised).__name__, str(raised))
    finally:
        checkpoint_write._local_part = local_part
    seconds = time.monotonic() - start
    dist.barrier()  # both ranks are past the failed save before rank 0 lists the directory
    return {
        "error": error,
        "seconds": seconds,
        "intact": {str(p.relative_to(directory)): p.read_bytes() for p in directory.rglob("*") if p.is_file()} == before,
        "hidden": sorted(p.name for p in Path(out).iterdir() if p.name.startswith(".")),
    }


def _failing(plan, workers, unheld):
    raise RuntimeError(f"stage {workers[0].stage.index} cannot be saved, on purpose")


def _save_on_rank_0_only(pipe, rank: int, out: str) -> dict | None:
    pipe.timeout_s = ALONE_TIMEOUT_S
    if rank == 1:
        flag = Path(out) / "rank0-done"
        deadline = time.monotonic() + 30.0
        while not flag.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        return None
    start = time.monotonic()
    try:
        pipe.save(Path(out) / "alone")
        error = None
    except Exception as raised:  # noqa: BLE001 - the parent checks what it was
        error = (type(raised).__name__, str(raised))
    (Path(out) / "rank0-done").touch()
    return {"error": error, "seconds": time.monotonic() - start, "written": (Path(out) / "alone").exists()}


# ---- the parent ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> tuple[Path, list[dict]]:
    out = tmp_path_factory.mktemp("saves")
    results = spawn(_save_and_load, out, CASES, limit_s=LIMIT_S)
    for rank, result in enumerate(results):
        assert result is not None, f"rank {rank} saved nothing"
        assert "error" not in result, f"rank {rank} failed:\n{result['error']}"
    return out, results


@pytest.mark.parametrize("case", CASES, ids="-".join)
def test_distributed_save_loads_in_one_process_like_a_single_process_run(ranks, case):
    # imported here, not at the top: it imports transformers, 1.5 s in each spawned rank

    out, results = ranks
    alone, batches = compile_case("tied-gpt", *case)  # the same training in one process
    pipeline_train(alone, batches[:SAVED_AFTER])
    loaded = sw.load(_case_dir(out, case))
    assert [(s.index, s.device, s.layers) for s in loaded.plan.stages] == [
        (s.index, s.device, s.layers) for s in alone.plan.stages
    ]
    assert [w.swapped for w in loaded._workers] == [w.swapped for w in alone._workers]
    assert_state_equal(loaded.state_dict(), alone.state_dict())
    assert_optimizer_state_equal(optimizer_state(loaded), optimizer_state(alone))
    want = torch.stack(pipeline_train(alone, _more()))
    torch.testing.assert_close(torch.stack(pipeline_train(loaded, _more())), want, rtol=RTOL, atol=ATOL)
    for result in (r[case] for r in results):
        # the ranks trained on identically from the checkpoint they loaded and from where they were
        torch.testing.assert_close(
            torch.stack(result["loaded"]), torch.stack(result["original"]), rtol=0, atol=0
        )
        torch.testing.assert_close(torch.stack(result["loaded"]), want, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("case", CASES, ids="-".join)
def test_every_rank_returns_once_the_checkpoint_is_complete(ranks, case):
    out, results = ranks
    written = sorted(p.name for p in _case_dir(out, case).iterdir())
    stages = results[0][case]["all_stages"]
    assert {"plan.json", "graph.json", "programs.txt", "training.pt", "stagewise.json", "weights"} | {
        f"stage_{i}.{x}" for i in stages for x in ("py", "json")
    } == set(written)
    shards = sorted(p.name for p in (_case_dir(out, case) / "weights").iterdir())
    assert shards == [".metadata"] + [f"__{rank}_0.distcp" for rank in range(len(results))]  # each rank wrote its own
    plan = sw.Plan.from_json((_case_dir(out, case) / "plan.json").read_text())
    for rank, result in enumerate(results):
        assert result[case]["seen"] == written
        # loaded under torch.distributed, each rank holds its own stages
        assert result[case]["stages"] == [s.index for s in plan.stages if s.device == rank]


@pytest.mark.parametrize("how", ["snapshot", "write"])
def test_a_failed_save_fails_on_every_rank_and_keeps_the_earlier_checkpoint(ranks, how):
    """Rank 1 cannot snapshot its stages, or rank 0 cannot write: both ranks raise at once (the one
    that failed its own error, the other a PlanError naming it) and nothing on disk changed."""
    _, results = ranks
    first, second = (r[f"failing {how}"] for r in results)
    failed, told = (second, first) if how == "snapshot" else (first, second)
    assert failed["error"][0] == {"snapshot": "RuntimeError", "write": "FileExistsError"}[how], failed
    assert told["error"][0] == "PlanError" and f"rank {1 if how == 'snapshot' else 0}" in told["error"][1], (
        told
    )
    assert "earlier checkpoint there is intact" in told["error"][1]
    assert first["intact"] and second["intact"]
    assert first["hidden"] == []  # no staging directory left behind
    assert max(first["seconds"], second["seconds"]) < TIMEOUT_S


def test_save_on_rank_0_only_is_a_peer_error_not_a_hang(ranks):
    _, results = ranks
    result = results[0]["rank 0 alone"]
    assert result["error"][0] == "PeerError" and "every rank must call pipe.save" in result["error"][1], (
        result
    )
    assert result["seconds"] < ALONE_TIMEOUT_S + 3.0 and not result["written"]


def test_an_asynchronous_save_under_two_ranks_holds_the_state_at_the_save(ranks):
    """tests/test_async_save.py's case under two gloo ranks, run by this pair: the write held back
    while a step runs, let go beside the next step's collectives."""
    out, results = ranks
    check_saved_on_two_ranks(out / "asynchronous", [result["asynchronous"] for result in results])
