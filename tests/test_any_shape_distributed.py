"""Batches of any shape under torch.distributed: two gloo ranks train on varying sequence lengths and
uneven last batches like eager training. Each receiver sizes its buffer from the step's own shapes
(compiler/assembly/step_shapes.py), which every rank derives alike from the batch it was given."""

from __future__ import annotations

import copy
import functools
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import stagewise as sw
from tests.harness.any_shape import eager_split_train, train_steps, varied_gpt_batches, varied_lm_batches
from tests.harness.ranks import run_cases, spawn
from tests.models.gpt import TinyGPT, lm_loss
from tests.models.mlp import mlp
from tests.reference import ADAMW, ATOL, RTOL, assert_state_equal

# (problem, schedule, resumed): a resumed case saves after the first step and trains on with the
# pipeline sw.load gives every rank (another rank's stage code comes back on the meta device). Every
# pair of the three is some case's: GPT-2 compiled takes new shapes under varuna, loaded under 1f1b.
CASES = (("hf-gpt2", "varuna", False), ("tied-gpt", "gpipe", False), ("hf-gpt2", "1f1b", True),
         ("mlp-bf16", "1f1b", False))


def _problem(name: str):
    torch.manual_seed(0)
    if name == "hf-gpt2":
        from tests.hf import gpt2

        return gpt2(2), varied_lm_batches(), {"microbatches": 2}
    if name == "mlp-bf16":  # after its first Linear every activation is bf16 under autocast, so are transfers
        generator = torch.Generator().manual_seed(0)
        batches = [((torch.randn(b, 8, generator=generator),), torch.randint(0, 5, (b,), generator=generator))
                   for b in (8, 7, 5)]
        return mlp(), batches, {"microbatches": 2, "loss_fn": F.cross_entropy, "precision": "bf16"}
    return TinyGPT(), varied_gpt_batches(), {"microbatches": 4, "loss_fn": lm_loss}


def _ranks(rank: int, init_file: str, out: str) -> None:
    run_cases(rank, init_file, out, CASES, functools.partial(_run_case, Path(out)))


def _run_case(out: Path, case) -> dict:
    name, schedule, resumed = case
    model, batches, options = _problem(name)
    inputs, target = batches[0]
    if target is not None:
        options["example_target"] = target
    pipe = sw.compile(model, 2, inputs, schedule=schedule, optimizer=ADAMW, cost="analytic", **options)
    pipe.timeout_s = 20.0
    losses = train_steps(pipe, batches[:1])
    if resumed:
        pipe.save(out / "checkpoint")
        pipe = sw.load(out / "checkpoint")
    losses += train_steps(pipe, batches[1:])
    return {"losses": losses, "state": {k: v.clone() for k, v in pipe.state_dict().items()}}


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> list[dict]:
    results = spawn(_ranks, tmp_path_factory.mktemp("shapes"), limit_s=120.0, fail_on_hang=False)
    return [result or {} for result in results]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(c[:2]) + ("-resumed" if c[2] else ""))
def test_two_ranks_train_on_any_shape_like_eager(trained, case):
    for rank, result in enumerate(trained):
        assert case in result, f"rank {rank} did not reach {case} (a hang or an earlier failure)"
        assert "error" not in result[case], f"rank {rank}:\n{result[case]['error']}"
    model, batches, options = _problem(case[0])
    if options.get("precision") == "bf16":  # bf16 activations are sent as bf16 (their receivers know)
        _assert_like_one_process(trained, case, model, batches, options)
        return
    reference = copy.deepcopy(model)
    want = eager_split_train(reference, batches, microbatches=1, loss_fn=options.get("loss_fn"), optimizer=ADAMW)
    for result in trained:
        torch.testing.assert_close(torch.stack(result[case]["losses"]), torch.stack(want), rtol=RTOL, atol=ATOL)
        assert_state_equal(result[case]["state"], reference.state_dict())


def _assert_like_one_process(trained, case, model, batches, options) -> None:
    """The same plan in one process computes the same ops on the same dtypes: bitwise the ranks' result."""
    inputs, target = batches[0]
    pipe = sw.compile(model, 2, inputs, example_target=target, schedule=case[1], optimizer=ADAMW, cost="analytic",
                      **options)
    pieces = [{pipe.plan.graph_inputs[0]: inputs[0][:4], pipe.plan.graph_inputs[1]: target[:4]}]
    assert {dtype for _, dtype in pipe._feeding.step_shapes.of_step(pieces).values()} == {torch.bfloat16}
    want = train_steps(pipe, batches)
    for result in trained:
        torch.testing.assert_close(torch.stack(result[case]["losses"]), torch.stack(want), rtol=0, atol=0)
        assert_state_equal(result[case]["state"], pipe.state_dict())
