"""Tensor parallelism x pipelining (issue 26): GPT-2 over T = 2 x P = 2 on four gloo ranks trains
like eager; rank d·2 + t runs device d's stages at tensor-parallel position t (ir/tensor_parallel.py's
`RankLayout`), p2p among ranks of one position, the stage's all-reduces on its own group. Its
checkpoint (each rank's shards, DCP) loads into T = 1 and a T = 1 one into T = 2, training on as
the uninterrupted run; a crafted split in plan.json is a CheckpointError.

One spawned four-rank world runs the cases (tests/harness/ranks.py); each check is its own test.
"""

from __future__ import annotations

import copy
import functools
import json
from pathlib import Path

import pytest
import torch

import stagewise as sw
from stagewise.compiler.checkpoint.dcp import read_metadata
from stagewise.ir.errors import CheckpointError, OptionError
from stagewise.ir.tensor_parallel import RankLayout
from tests import hf
from tests.harness.crafted import crafted
from tests.harness.ranks import case_results, run_cases, spawn
from tests.reference import ATOL, RTOL, assert_state_equal, eager_train, pipeline_train

RANKS, LIMIT_S = 4, 200.0
SGD = functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9)  # as tests/test_tensor_parallel.py: no AdamW eps noise
CLIP = 0.5  # below the first step's norm: the global norm must add every stage's and every shard's squares
CASES = ("trained", "t1_into_t2", "t2_reloaded", "failed_step")
FAILING_RANK = 3  # device 1 at position 1: its partner, rank 2, waits in the stage's first all-reduce


def _setup() -> tuple[torch.nn.Module, list]:
    torch.manual_seed(0)
    return hf.gpt2(2), hf.lm_batches(steps=2)


def _compile(model: torch.nn.Module, batches: list, tensor_parallel: int) -> sw.Pipeline:
    return sw.compile(model, ["cpu", "cpu"], batches[0][0], microbatches=2, cost="analytic", optimizer=SGD,
                      tensor_parallel=tensor_parallel, clip_grad_norm=CLIP, stages=2)


def _trained(out: Path) -> dict:
    """Two steps at T = 2 x P = 2 (saved after the first) against eager."""
    model, batches = _setup()
    reference = copy.deepcopy(model)
    pipe = _compile(model, batches, 2)
    losses = pipeline_train(pipe, batches[:1])
    pipe.save(out / "t2")
    losses += pipeline_train(pipe, batches[1:])
    norms: list[float] = []
    made: list[torch.optim.Optimizer] = []
    want = eager_train(reference, batches, optimizer=lambda params: made.append(SGD(params)) or made[-1],
                       microbatches=2, clip_grad_norm=CLIP, norms=norms)
    eager_momentum = {name: made[0].state[p]["momentum_buffer"] for name, p in reference.named_parameters()}
    momentum = {name: values["momentum_buffer"] for name, values in pipe.optimizer.state_dict()["state"].items()}
    reference.eval()
    with torch.no_grad():
        eager_eval, eager_logits = reference(**batches[0][0])[:2]
    return {"losses": torch.stack(losses), "want": torch.stack(want), "state": _state(pipe),
            "want_state": reference.state_dict(), "norm": pipe.last_grad_norm, "want_norm": norms[-1],
            "evaluated": pipe.evaluate(**batches[0][0]), "eager_eval": eager_eval,
            "logits": pipe.predict(**batches[0][0]).logits, "eager_logits": eager_logits,
            "momentum": momentum, "eager_momentum": eager_momentum,
            "held": {n: tuple(p.shape) for worker in pipe._workers for n, p in worker.module.named_parameters()},
            "devices": sorted({worker.stage.device for worker in pipe._workers}), "plan": str(pipe.plan)}


def _state(pipe: sw.Pipeline) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in pipe.state_dict().items()}


def _second_step(pipe: sw.Pipeline) -> dict:
    """The second step of a pipeline loaded from a checkpoint of the first."""
    _, batches = _setup()
    loss = pipeline_train(pipe, batches[1:])[0]
    return {"loss": loss, "state": _state(pipe), "degree": pipe.plan.rank_layout().degree}


class InjectedFault(RuntimeError):
    pass


def _failed_step(rank: int) -> dict:
    """A good step, a step whose stage forward fails on one rank before its first all-reduce, a
    good step: what each rank raised, and the losses and state of the good steps."""
    model, batches = _setup()
    pipe = _compile(model, batches, 2)
    losses = pipeline_train(pipe, batches[:1])
    if rank == FAILING_RANK:
        (worker,) = pipe._workers
        call = worker.call

        def failing(*args, **kwargs):
            worker.call = call  # once
            raise InjectedFault("the stage's forward failed on purpose")

        worker.call = failing
    try:
        pipeline_train(pipe, batches[1:])
        raised = None
    except Exception as error:  # noqa: BLE001 - the parent checks what it was
        raised = (type(error).__name__, str(error))
    losses += pipeline_train(pipe, batches[1:])
    return {"raised": raised, "losses": torch.stack(losses), "state": _state(pipe)}


def _case(rank: int, out: str, case: str) -> dict:
    if case == "trained":
        return _trained(Path(out))
    if case == "failed_step":
        return _failed_step(rank)
    if case == "t1_into_t2":  # the parent's T = 1 checkpoint, planned again for T = 2
        return _second_step(sw.load(Path(out) / "t1", tensor_parallel=2))
    return _second_step(sw.load(Path(out) / "t2"))  # the saved T = 2 plan, its stage code rebuilt


def _cases(rank: int, init_file: str, out: str) -> None:
    run_cases(rank, init_file, out, CASES, functools.partial(_case, rank, out), ranks=RANKS)


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("tpxp")


@pytest.fixture(scope="module")
def trained(folder):
    model, batches = _setup()
    pipe = _compile(model, batches, 1)
    pipeline_train(pipe, batches[:1])
    pipe.save(folder / "t1")
    return spawn(_cases, folder, limit_s=LIMIT_S, ranks=RANKS)


def test_two_by_two_trains_like_eager(trained):
    """Losses, the clipped global norm, the whole state, evaluate and predict equal eager on every rank."""
    for result in case_results(trained, "trained", LIMIT_S):
        torch.testing.assert_close(result["losses"], result["want"], rtol=RTOL, atol=ATOL)
        assert result["want_norm"] > CLIP
        assert result["norm"] == pytest.approx(result["want_norm"], rel=1e-5)
        assert_state_equal(result["state"], result["want_state"])
        torch.testing.assert_close(result["evaluated"], result["eager_eval"], rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(result["logits"], result["eager_logits"], rtol=RTOL, atol=ATOL)


def test_each_rank_runs_its_device_at_its_position(trained):
    """Ranks 0, 1 hold device 0's stage, ranks 2, 3 device 1's, each its half of the split matrices;
    the optimizer's state reads whole on every rank, equal to eager's."""
    results = case_results(trained, "trained", LIMIT_S)
    assert [r["devices"] for r in results] == [[0], [0], [1], [1]]
    held = [r["held"] for r in results]
    first, last = "transformer.h.0.attn.c_attn.weight", "transformer.h.1.mlp.c_proj.weight"
    assert held[0][first] == held[1][first] == (32, 48) and first not in held[2]
    assert held[2][last] == held[3][last] == (64, 32) and last not in held[0]
    for result in results:
        assert_state_equal(result["momentum"], result["eager_momentum"])
    assert "dev0 -> ranks [0, 1], dev1 -> ranks [2, 3]" in results[0]["plan"]


@pytest.mark.parametrize("case", ["t1_into_t2", "t2_reloaded"])
def test_checkpoints_load_at_any_degree_and_train_on_as_uninterrupted(trained, case):
    """A T = 1 checkpoint loaded at T = 2, and the T = 2 one at its own plan: the second step as eager's."""
    want = case_results(trained, "trained", LIMIT_S)[0]
    for result in case_results(trained, case, LIMIT_S):
        assert result["degree"] == 2
        torch.testing.assert_close(result["loss"], want["want"][1], rtol=RTOL, atol=ATOL)
        assert_state_equal(result["state"], want["want_state"])


def test_a_t2_checkpoint_loads_into_t1_and_trains_on(trained, folder):
    """The ranks' shards (DTensor chunks; GPT-2's fused c_attn whole) read whole in one process."""
    want = case_results(trained, "trained", LIMIT_S)[0]
    weights = folder / "t2" / "weights"
    tensors = read_metadata((weights / ".metadata").read_bytes(), weights).state_dict_metadata
    chunks = {key: [tuple(c.offsets) for c in tensors[key].chunks] for key in (
        "model.transformer.h.0.mlp.c_fc.weight", "optimizer.state.transformer.h.1.mlp.c_proj.weight.momentum_buffer",
        "model.transformer.h.0.attn.c_attn.weight")}
    assert list(chunks.values()) == [[(0, 0), (0, 64)], [(0, 0), (64, 0)], [(0, 0)]]  # by columns, by rows, whole
    result = _second_step(sw.load(folder / "t2", tensor_parallel=1))
    assert result["degree"] == 1
    torch.testing.assert_close(result["loss"], want["want"][1], rtol=RTOL, atol=ATOL)
    assert_state_equal(result["state"], want["want_state"])


def test_another_degree_without_a_new_plan_is_refused(trained, folder):
    case_results(trained, "trained", LIMIT_S)  # the checkpoint was written
    with pytest.raises(OptionError, match="another T needs a new plan"):
        sw.load(folder / "t2", tensor_parallel=1, replan=False)
    with pytest.raises(OptionError, match="tensor_parallel="):
        sw.load(folder / "t2", tensor_parallel=0)


def test_a_step_failed_on_one_rank_of_a_stage_is_undone_on_every_rank(trained):
    """Its partner stops waiting in the stage's all-reduce (the failure notice), every rank undoes
    the step, the drain completes that all-reduce, and training goes on as eager's without it."""
    want = case_results(trained, "trained", LIMIT_S)[0]
    for rank, result in enumerate(case_results(trained, "failed_step", LIMIT_S)):
        name, message = result["raised"]
        if rank == FAILING_RANK:
            assert name == "InjectedFault", result["raised"]
        else:
            assert name == "StepFailedError" and f"rank {FAILING_RANK} failed" in message, result["raised"]
        torch.testing.assert_close(result["losses"], want["want"], rtol=RTOL, atol=ATOL)
        assert_state_equal(result["state"], want["want_state"])


def _split_of(parameter: str, **changes: int):
    """plan.json with `parameter`'s recorded split (its dim, groups, or the degree) changed."""
    def rewrite(data: bytes) -> bytes:
        plan = json.loads(data)
        parallel = plan["tensor_parallel"]
        if "degree" in changes:
            parallel["degree"] = changes["degree"]
        for block in parallel["blocks"]:
            for entry in block["parameters"]:
                if entry["name"] == parameter:
                    entry.update({k: v for k, v in changes.items() if k != "degree"})
        return json.dumps(plan).encode()
    return rewrite


@pytest.mark.parametrize(("parameter", "changes", "message"), [
    ("transformer.h.0.attn.c_attn.weight", {"groups": 5}, "divides by groups x degree"),
    ("transformer.h.0.mlp.c_fc.weight", {"dim": 0}, "declares the tensor"),
    ("transformer.h.0.mlp.c_fc.weight", {"degree": 4}, "declares the tensor"),
    ("transformer.h.0.mlp.c_fc.bias", {"name": "transformer.wpe.nothing"}, "a parameter of the model"),
])
def test_a_crafted_split_is_refused_before_anything_is_allocated(trained, folder, tmp_path, parameter, changes,
                                                                message):
    """The split plan.json records checked against the weights' shapes and the stages' declared
    parts: a CheckpointError, not a stage cut from sizes no weight has."""
    case_results(trained, "trained", LIMIT_S)  # the checkpoint was written
    copy_ = crafted(folder / "t2", tmp_path, "plan.json", _split_of(parameter, **changes))
    with pytest.raises(CheckpointError, match=message):
        sw.load(copy_)


def test_rank_layout_maps_both_ways():
    layout = RankLayout(devices=3, degree=2)
    pairs = [(d, t) for d in range(3) for t in range(2)]
    assert [layout.rank(d, t) for d, t in pairs] == list(range(layout.world_size))
    assert [(layout.device_of(r), layout.position_of(r)) for r in range(6)] == pairs
    assert layout.ranks_of(1) == (2, 3)
