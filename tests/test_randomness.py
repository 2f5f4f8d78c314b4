"""Randomness is part of the plan: every random op draws from a stream keyed by (seed, step, op,
microbatch), so a recompute draws its forward's masks, training with dropout is the same whatever
the plan (and across processes), runs are reproducible, checkpoints resume the streams, and the
user's own global generator never moves. A recompute leaves BatchNorm's running statistics alone.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import stagewise as sw
from stagewise.ir.errors import OptionError
from stagewise.ir.instructions import Recompute
from stagewise.ir.random_streams import DrawKey, drawing, keyed_dropout
from tests.harness.ranks import join, save_result, spawn
from tests.models.cnn import ResNet
from tests.models.dropout import DropoutGPT, MaskProbe, RandomLeaves
from tests.models.gpt import lm_loss
from tests.reference import ADAMW, ATOL, RTOL, assert_state_equal, check_equal_training, pipeline_train

STEPS = 3


def _token_batches(steps: int = STEPS):
    torch.manual_seed(0)
    out = []
    for _ in range(steps):
        ids = torch.randint(0, 64, (8, 9))
        out.append(((ids[:, :-1],), ids[:, 1:]))
    return out


def _train_gpt(devices: int, schedule: str, batches, *, tie: bool = True, seed: int = 1, **options):
    """DropoutGPT from torch.manual_seed(seed), compiled (analytic costs: the same plan every run) and trained."""
    torch.manual_seed(seed)
    inputs, target = batches[0]
    pipe = sw.compile(DropoutGPT(tie=tie), devices, inputs, loss_fn=lm_loss, example_target=target, microbatches=4,
                      schedule=schedule, cost="analytic", optimizer=ADAMW, **options)
    return pipe, torch.stack(pipeline_train(pipe, batches))


# ---- a recompute draws the masks of its forward ---------------------------------------------------
def _probe_masks(schedule: str, draw: str) -> tuple[torch.Tensor, torch.Tensor]:
    """One step of MaskProbe: the masks the forwards drew (read from the loss's bits) and the masks the
    backward differentiated (read from w's SGD update), one row per microbatch."""
    probe = MaskProbe(microbatches=4, width=5, draw=draw)
    before = probe[0].w.detach().clone()
    which = torch.arange(4)  # one sample per microbatch, sample j reads row j of w
    pipe = sw.compile(probe, 2, (which,), microbatches=4, schedule=schedule, cost="analytic", split_points=["1"],
                      optimizer=functools.partial(torch.optim.SGD, lr=1.0))
    loss = pipe.step(which)
    bits = int(loss.item() * 4 / 2)  # mean over 4 microbatches of sums of 2 * mask * 2^k: exact in float32
    forward = torch.tensor([(bits >> k) & 1 for k in range(20)], dtype=torch.float32).view(4, 5)
    backward = (before - pipe.state_dict()["0.w"]) * 2  # gradient of row j: mask_j * 2 / 4
    return forward, backward


@pytest.mark.parametrize("draw", ["dropout", "bernoulli"])
@pytest.mark.parametrize("schedule", ["gpipe", "varuna"])
def test_recompute_draws_the_masks_of_its_forward(schedule, draw):
    """Under varuna stage 0 recomputes every forward before its backward: the gradient must come from
    the forward's masks, exactly (nn.Dropout takes a seeded generator, torch.bernoulli the lock)."""
    forward, backward = _probe_masks(schedule, draw)
    assert 0 < forward.sum() < forward.numel()  # masks, not all kept or all dropped
    assert torch.equal(forward, backward)
    assert len({tuple(row.tolist()) for row in forward}) > 1  # each microbatch draws its own mask


def test_keyed_streams_differ_by_step_op_and_microbatch():
    x = torch.ones(64)
    with drawing(seed=3, step=0, microbatch=0):
        first, again, other_op = keyed_dropout(0, x), keyed_dropout(0, x), keyed_dropout(1, x)
    with drawing(seed=3, step=1, microbatch=0):
        next_step = keyed_dropout(0, x)
    with drawing(seed=3, step=0, microbatch=1):
        next_microbatch = keyed_dropout(0, x)
    assert torch.equal(first, again)
    for different in (other_op, next_step, next_microbatch):
        assert not torch.equal(first, different)
    assert len({DrawKey(3, s, m).stream_seed(o) for s in range(4) for m in range(4) for o in range(4)}) == 64


# ---- the same training whatever the plan -----------------------------------------------------------
# (devices, schedule, options); the reference is one device under gpipe. tests/test_gradient_order.py
# trains this very model (untied DropoutGPT, seed 1, the same batches, four microbatches; SGD there, and
# the optimizer draws nothing) bitwise like that reference under gpipe, 1f1b, interleaved, varuna and
# harmony-pp on two devices and 1f1b on four; the plans here are the others: more devices, given cuts,
# replicas, recomputation.
PLANS = [
    (4, "gpipe", {}), (2, "gpipe", {"split_points": ["blocks.1"]}),
    (3, "gpipe", {"split_points": ["blocks.0", "blocks.3"]}), (4, "varuna", {}),
    (2, "harmony-dp", {}), (4, "varuna", {"replicas": 2}),
    (2, "1f1b", {"activations": "recompute"}),  # stage 0 recomputes, stage 1 keeps (passes/activations.py)
    (2, "interleaved", {"activations": "recompute"}),  # every virtual stage but the last recomputes
]


@pytest.fixture(scope="module")
def untied_reference():
    batches = _token_batches()
    pipe, losses = _train_gpt(1, "gpipe", batches, tie=False)
    return batches, losses, pipe.state_dict()


@pytest.mark.parametrize("devices,schedule,options", PLANS, ids=[f"{d}-{s}-{'-'.join(o) or 'default'}"
                                                                  for d, s, o in PLANS])
def test_dropout_training_is_the_same_whatever_the_plan(untied_reference, devices, schedule, options):
    """Every loss and parameter is bitwise the one-device pipeline's: the same masks, the same forward
    arithmetic, and every schedule sums each gradient over the microbatches in microbatch order
    (tests/test_gradient_order.py). Replicas (harmony-dp, replicas=2) all-reduce partial sums: another order."""
    batches, want_losses, want_state = untied_reference
    pipe, losses = _train_gpt(devices, schedule, batches, tie=False, **options)
    assert torch.equal(losses, want_losses), (losses, want_losses)
    state = pipe.state_dict()
    if all(stage.replica == 0 for stage in pipe.plan.stages):
        assert all(torch.equal(state[k], want_state[k]) for k in want_state)
    else:
        assert_state_equal(state, want_state)


def test_tied_gpt_with_dropout_trains_alike_under_every_schedule():
    """With the tied embedding the two stages' gradient parts are summed by the all-reduce: equal to
    float rounding across schedules (the first step's loss, before any update, bitwise)."""
    batches = _token_batches()
    _, want = _train_gpt(1, "gpipe", batches)
    for schedule in ("1f1b", "varuna", "harmony-dp"):
        _, losses = _train_gpt(2, schedule, batches)
        assert torch.equal(losses[0], want[0])
        torch.testing.assert_close(losses, want, rtol=RTOL, atol=ATOL)


def _hf_gpt2_with_dropout(p: float = 0.1):
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=128, n_positions=32, resid_pdrop=p,
                        embd_pdrop=p, attn_pdrop=p, bos_token_id=0, eos_token_id=0, tie_word_embeddings=False)
    return GPT2LMHeadModel(config)


def test_hugging_face_gpt2_with_dropout_is_the_same_under_recompute():
    """torch.export's graph: ATen dropout and SDPA with dropout_p, keyed; varuna equals gpipe."""
    from tests.hf import lm_batches

    batches = lm_batches(2)
    results = []
    for devices, schedule in ((1, "gpipe"), (2, "varuna")):
        torch.manual_seed(1)
        pipe = sw.compile(_hf_gpt2_with_dropout(), devices, batches[0][0], microbatches=4, schedule=schedule,
                          cost="analytic", optimizer=ADAMW)
        results.append((torch.stack(pipeline_train(pipe, batches)), pipe.state_dict()))
    code = "\n".join(stage.code for stage in pipe.stages)
    assert "keyed_dropout(" in code and "keyed(1, torch.ops.aten.scaled_dot_product_attention" in code
    (want, want_state), (got, state) = results
    assert torch.equal(got, want)
    assert_state_equal(state, want_state)


def test_random_leaf_modules_replay_in_the_recompute_and_after_load(tmp_path):
    """Dropout1d, RReLU, attention dropout, rand_like: varuna trains bitwise as gpipe, and a loaded
    checkpoint draws what the saved pipeline draws next."""
    inputs = (torch.randn(4, 3, 8),)
    losses = {}
    for schedule in ("gpipe", "varuna"):
        torch.manual_seed(0)
        pipe = sw.compile(RandomLeaves(), 2, inputs, microbatches=2, schedule=schedule, cost="analytic")
        losses[schedule] = torch.stack([pipe.step(*inputs) for _ in range(2)])
    assert any("keyed(" in stage.code for stage in pipe.stages) and pipe.plan.tracer == "fx"
    assert torch.equal(losses["gpipe"], losses["varuna"])
    pipe.save(tmp_path / "ckpt")
    assert torch.equal(sw.load(tmp_path / "ckpt").step(*inputs), pipe.step(*inputs))


def test_without_dropout_the_code_is_unchanged_and_trains_like_eager():
    """p = 0 (or eval mode) draws nothing: no keyed op in the stage code, eager's training exactly."""
    batches = _token_batches(2)
    torch.manual_seed(1)
    pipe = check_equal_training(DropoutGPT(p=0.0), batches, 2, loss_fn=lm_loss, microbatches=4, schedule="varuna",
                                cost="analytic")
    assert not any("keyed" in stage.code for stage in pipe.stages)


# ---- reproducible runs, and the user's own stream ------------------------------------------------
def test_the_same_manual_seed_before_compile_trains_alike():
    batches = _token_batches()
    first = _train_gpt(2, "1f1b", batches, seed=5)
    second = _train_gpt(2, "1f1b", batches, seed=5)
    assert first[0].plan.seed == second[0].plan.seed == 5
    assert torch.equal(first[1], second[1])
    assert all(torch.equal(a, b) for a, b in zip(first[0].state_dict().values(), second[0].state_dict().values(),
                                                  strict=True))
    torch.manual_seed(5)
    model = DropoutGPT()
    torch.manual_seed(6)  # the same weights, another seed: other masks
    inputs, target = batches[0]
    other = sw.compile(model, 2, inputs, loss_fn=lm_loss, example_target=target, microbatches=4, schedule="1f1b",
                       cost="analytic", optimizer=ADAMW)
    assert other.plan.seed == 6
    assert not torch.equal(torch.stack(pipeline_train(other, batches)), first[1])


def test_seed_option_overrides_the_global_seed_and_is_checked():
    batches = _token_batches(1)
    inputs, target = batches[0]
    losses = []
    for global_seed in (1, 2):
        torch.manual_seed(0)
        model = DropoutGPT()
        torch.manual_seed(global_seed)
        pipe = sw.compile(model, 2, inputs, loss_fn=lm_loss, example_target=target, microbatches=4, cost="analytic",
                          schedule="gpipe", seed=7)
        assert pipe.plan.seed == 7 and sw.Plan.from_json(pipe.plan.to_json()).seed == 7
        losses.append(pipe.step(*inputs, target=target))
    assert torch.equal(losses[0], losses[1])
    for bad in (-1, 2**64, 1.5, True, "7"):
        with pytest.raises(OptionError, match="seed="):
            sw.compile(DropoutGPT(), 2, inputs, loss_fn=lm_loss, example_target=target, cost="analytic", seed=bad)


@pytest.mark.parametrize("draw", ["dropout", "bernoulli"])
def test_compile_and_step_leave_the_users_global_generator_alone(draw):
    """Keyed draws take no number from the global generator (the lock restores what it seeds), nor
    does compile (its probes and calibration draw as many samples as their timing asks)."""
    batches = _token_batches(1)
    pipe, _ = _train_gpt(2, "varuna", batches)
    torch.manual_seed(42)
    state = torch.get_rng_state()
    probe = sw.compile(MaskProbe(draw=draw), 2, (torch.arange(4),), microbatches=4, schedule="varuna",
                       split_points=["1"])  # profiled costs
    assert torch.equal(torch.get_rng_state(), state)
    pipeline_train(pipe, batches)
    probe.step(torch.arange(4))
    assert torch.equal(torch.get_rng_state(), state)


# ---- checkpoints hold the streams' position --------------------------------------------------
def test_resuming_from_a_checkpoint_draws_the_masks_of_uninterrupted_training(tmp_path):
    batches = _token_batches(4)
    pipe, _ = _train_gpt(2, "varuna", batches[:2])
    pipe.save(tmp_path / "ckpt")
    uninterrupted = torch.stack(pipeline_train(pipe, batches[2:]))
    loaded = sw.load(tmp_path / "ckpt")
    assert loaded.plan.seed == pipe.plan.seed and loaded._executor.state.iteration == 2
    resumed = torch.stack(pipeline_train(loaded, batches[2:]))
    assert torch.equal(resumed, uninterrupted)
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), pipe.state_dict().values(),
                                                  strict=True))


# ---- across processes --------------------------------------------------------------------------
def _train_on_rank(rank: int, init_file: str, out: str) -> None:
    """What each of the two gloo ranks runs: the in-process test's compile and training."""
    join(init_file, rank, 30.0)
    torch.set_num_threads(1)
    try:
        pipe, losses = _train_gpt(2, "varuna", _token_batches())
        result = {"losses": losses, "state": {k: v.clone() for k, v in pipe.state_dict().items()},
                  "seed": pipe.plan.seed}
    except Exception as error:  # noqa: BLE001 - the parent shows it
        result = {"error": repr(error)}
    save_result(Path(out) / f"rank{rank}.pkl", result)
    os._exit(0)  # skip the process group's teardown: the parent has what it needs


def test_two_gloo_ranks_draw_what_one_process_draws(tmp_path):
    ranks = spawn(_train_on_rank, tmp_path)
    pipe, losses = _train_gpt(2, "varuna", _token_batches())
    for result in ranks:
        assert result is not None and "error" not in result, result
        assert result["seed"] == pipe.plan.seed
        assert torch.equal(result["losses"], losses)
        assert all(torch.equal(result["state"][k], v) for k, v in pipe.state_dict().items())


# ---- recompute and BatchNorm ------------------------------------------------------------------
class ExportedResNet(ResNet):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] > 1:  # control flow on a size: fx cannot trace it, torch.export can
            x = super().forward(x)
        return x


@pytest.mark.parametrize("model,tracer", [(ResNet, "fx"), (ExportedResNet, "export")])
def test_varuna_with_batchnorm_equals_eager_buffers_included(model, tracer):
    """The recompute of each microbatch must not update the running statistics (nor
    num_batches_tracked) a second time: every buffer equals eager training's over the same microbatches
    (fx: BatchNorm modules update them in place; export: the graph copies new values into them)."""
    torch.manual_seed(0)
    batches = [((torch.randn(8, 3, 8, 8),), torch.randint(0, 10, (8,))) for _ in range(2)]
    pipe = check_equal_training(model(), batches, 2, loss_fn=F.cross_entropy, microbatches=4, schedule="varuna",
                                cost="analytic")
    assert pipe.plan.tracer == tracer
    assert any(isinstance(i, Recompute) for p in pipe.programs for i in p.instructions)
    buffers = [k for k in pipe.state_dict() if "running" in k or "num_batches" in k]
    assert buffers and int(pipe.state_dict()["stem_bn.num_batches_tracked"]) == 2 * 4

