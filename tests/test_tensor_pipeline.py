"""Tensor parallelism x pipelining (issue 26): GPT-2 over T = 2 x P = 2 on four gloo ranks trains
like eager; rank d·2 + t runs device d's stages at tensor-parallel position t (ir/tensor_parallel.py's
`RankLayout`), p2p among ranks of one position, the stage's all-reduces on its own group.

One spawned four-rank world runs the case (tests/harness/ranks.py); each check is its own test.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch

import stagewise as sw
from stagewise.ir.tensor_parallel import RankLayout
from tests import hf
from tests.harness.ranks import case_results, run_cases, spawn
from tests.reference import ATOL, RTOL, assert_state_equal, eager_train, pipeline_train

RANKS, LIMIT_S = 4, 150.0
SGD = functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9)  # as tests/test_tensor_parallel.py: no AdamW eps noise
CLIP = 0.5  # below the first step's norm: the global norm must add every stage's and every shard's squares


def _train(rank: int, case: str) -> dict:
    torch.manual_seed(0)
    model, batches = hf.gpt2(2), hf.lm_batches(steps=2)
    reference = copy.deepcopy(model)
    pipe = sw.compile(model, ["cpu", "cpu"], batches[0][0], microbatches=2, cost="analytic", optimizer=SGD,
                      tensor_parallel=2, clip_grad_norm=CLIP, stages=2)
    losses = pipeline_train(pipe, batches)
    norms: list[float] = []
    made: list[torch.optim.Optimizer] = []
    want = eager_train(reference, batches, optimizer=lambda params: made.append(SGD(params)) or made[-1],
                       microbatches=2, clip_grad_norm=CLIP, norms=norms)
    eager_momentum = {name: made[0].state[p]["momentum_buffer"] for name, p in reference.named_parameters()}
    state = {k: v.clone() for k, v in pipe.state_dict().items()}
    reference.eval()
    with torch.no_grad():
        eager_eval = reference(**batches[0][0]).loss
    momentum = {name: values["momentum_buffer"] for name, values in pipe.optimizer.state_dict()["state"].items()}
    return {"losses": torch.stack(losses), "want": torch.stack(want), "state": state,
            "want_state": reference.state_dict(), "norm": pipe.last_grad_norm, "want_norm": norms[-1],
            "evaluated": pipe.evaluate(**batches[0][0]), "eager_eval": eager_eval,
            "momentum": momentum, "eager_momentum": eager_momentum,
            "held": {n: tuple(p.shape) for worker in pipe._workers for n, p in worker.module.named_parameters()},
            "devices": sorted({worker.stage.device for worker in pipe._workers}), "plan": str(pipe.plan)}


def _cases(rank: int, init_file: str, out: str) -> None:
    run_cases(rank, init_file, out, ("gpt2",), functools.partial(_train, rank), ranks=RANKS)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    return spawn(_cases, tmp_path_factory.mktemp("tpxp"), limit_s=LIMIT_S, ranks=RANKS)


def test_two_by_two_trains_like_eager(trained):
    """Losses, the clipped global norm, the whole state and evaluate equal eager on every rank."""
    for result in case_results(trained, "gpt2", LIMIT_S):
        torch.testing.assert_close(result["losses"], result["want"], rtol=RTOL, atol=ATOL)
        assert result["want_norm"] > CLIP
        assert result["norm"] == pytest.approx(result["want_norm"], rel=1e-5)
        assert_state_equal(result["state"], result["want_state"])
        torch.testing.assert_close(result["evaluated"], result["eager_eval"], rtol=RTOL, atol=ATOL)


def test_each_rank_runs_its_device_at_its_position(trained):
    """Ranks 0, 1 hold device 0's stage, ranks 2, 3 device 1's, each its half of the split matrices;
    the optimizer's state reads whole on every rank, equal to eager's."""
    results = case_results(trained, "gpt2", LIMIT_S)
    assert [r["devices"] for r in results] == [[0], [0], [1], [1]]
    held = [r["held"] for r in results]
    first, last = "transformer.h.0.attn.c_attn.weight", "transformer.h.1.mlp.c_proj.weight"
    assert held[0][first] == held[1][first] == (32, 48) and first not in held[2]
    assert held[2][last] == held[3][last] == (64, 32) and last not in held[0]
    for result in results:
        assert_state_equal(result["momentum"], result["eager_momentum"])
    assert "dev0 -> ranks [0, 1], dev1 -> ranks [2, 3]" in results[0]["plan"]


def test_rank_layout_maps_both_ways():
    layout = RankLayout(devices=3, degree=2)
    pairs = [(d, t) for d in range(3) for t in range(2)]
    assert [layout.rank(d, t) for d, t in pairs] == list(range(layout.world_size))
    assert [(layout.device_of(r), layout.position_of(r)) for r in range(6)] == pairs
    assert layout.ranks_of(1) == (2, 3)
