"""One compiled pipeline trains on batches of any shape the stage code takes, like eager training.

Sequence lengths vary from step to step (padded per batch), images come in other sizes, and the last
batch of an epoch does not divide into the microbatches (uneven microbatches, each weighing its
share of the batch). The example inputs are the largest shape (memory is planned for them); larger
or smaller-than-traceable shapes are refused before anything runs, naming the limit.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.nn.functional as F

import stagewise as sw
from tests.harness.any_shape import eager_split_train, train_steps, varied_gpt_batches, varied_lm_batches
from tests.hf import gpt2, llama
from tests.models.cnn import ResNet
from tests.models.gpt import TinyGPT, lm_loss
from tests.models.mlp import mlp
from tests.reference import ADAMW, ATOL, RTOL, SGD, assert_state_equal

LM_CASES = {
    "hf-gpt2-1": (gpt2, 1, 2, "gpipe"), "hf-gpt2-2": (gpt2, 2, 2, "1f1b"), "hf-gpt2-4": (gpt2, 4, 4, "1f1b"),
    "hf-llama-2": (llama, 2, 2, "gpipe"), "hf-llama-4": (llama, 4, 4, "varuna"),
}


@pytest.mark.parametrize(("build", "devices", "microbatches", "schedule"), LM_CASES.values(), ids=LM_CASES.keys())
def test_hf_lm_trains_on_any_length_and_an_uneven_last_batch(build, devices, microbatches, schedule):
    """The export path: the stage code reads each size from its inputs, so one pipeline takes every
    sequence length; the uneven batches weigh each microbatch by its samples, as eager's mean does."""
    torch.manual_seed(0)
    model = build(2)
    reference = copy.deepcopy(model)
    batches = varied_lm_batches()
    pipe = sw.compile(model, devices, batches[0][0], microbatches=microbatches, schedule=schedule,
                      optimizer=ADAMW, cost="analytic")
    assert any("sym_size" in stage.code for stage in pipe.stages), "the stage code should read sizes"
    got = train_steps(pipe, batches)
    want = eager_split_train(reference, batches, microbatches=1, optimizer=ADAMW)  # eager on the whole batch
    torch.testing.assert_close(torch.stack(got), torch.stack(want), rtol=RTOL, atol=ATOL)
    assert_state_equal(pipe.state_dict(), reference.state_dict())


@pytest.mark.parametrize(("devices", "swap"), [(2, "off"), (4, "on")])
def test_fx_gpt_trains_on_any_length_and_an_uneven_last_batch(devices, swap):
    """With swap on, the shapes of a step are read from parameters that live in host memory."""
    torch.manual_seed(0)
    model = TinyGPT()
    reference = copy.deepcopy(model)
    batches = varied_gpt_batches()
    inputs, target = batches[0]
    pipe = sw.compile(model, devices, inputs, loss_fn=lm_loss, example_target=target, microbatches=4,
                      optimizer=ADAMW, cost="analytic", swap=swap)
    got = train_steps(pipe, batches)
    want = eager_split_train(reference, batches, microbatches=1, loss_fn=lm_loss, optimizer=ADAMW)
    torch.testing.assert_close(torch.stack(got), torch.stack(want), rtol=RTOL, atol=ATOL)
    assert_state_equal(pipe.state_dict(), reference.state_dict())


def test_cnn_trains_on_smaller_images_and_uneven_microbatches():
    """BatchNorm sees each microbatch as eager gradient accumulation over the same split does."""
    torch.manual_seed(0)
    model = ResNet()
    reference = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(0)
    batches = [((torch.randn(b, 3, s, s, generator=generator),), torch.randint(0, 10, (b,), generator=generator))
               for b, s in ((8, 16), (8, 12), (7, 16), (6, 9))]
    inputs, target = batches[0]
    pipe = sw.compile(model, 2, inputs, loss_fn=F.cross_entropy, example_target=target, microbatches=4,
                      optimizer=SGD, cost="analytic")
    got = train_steps(pipe, batches)
    want = eager_split_train(reference, batches, microbatches=4, loss_fn=F.cross_entropy, optimizer=SGD)
    torch.testing.assert_close(torch.stack(got), torch.stack(want), rtol=RTOL, atol=ATOL)
    assert_state_equal(pipe.state_dict(), reference.state_dict())


def test_evaluate_takes_other_lengths_too():
    torch.manual_seed(0)
    model = gpt2(2)
    batches = varied_lm_batches()
    pipe = sw.compile(model, 2, batches[0][0], microbatches=2, cost="analytic")
    inputs = batches[3][0]  # 5 samples of 12 tokens: microbatches of 3 and 2
    model.eval()
    with torch.no_grad():
        want = model(**inputs).loss
    torch.testing.assert_close(pipe.evaluate(**inputs), want, rtol=RTOL, atol=ATOL)


@functools.cache
def _gpt2_pipe():
    torch.manual_seed(0)
    ids = torch.randint(1, 128, (8, 12))
    return sw.compile(gpt2(2), 2, {"input_ids": ids, "labels": ids}, microbatches=2, cost="analytic")


def _ids(batch: int, length: int) -> dict:
    ids = torch.randint(1, 128, (batch, length))
    return {"input_ids": ids, "labels": ids}


REFUSED = {
    "longer-than-planned": (lambda: _ids(8, 13), sw.ExampleInputsError, r"\[13\] but the example had \[12\].*largest"),
    "larger-batch": (lambda: _ids(10, 12), sw.BatchSizeError, "batch of 10.*2 microbatches of 4.*at most 8"),
    "fewer-samples-than-microbatches": (lambda: _ids(1, 12), sw.BatchSizeError, "batch of 1.*give a batch of"),
    "length-one": (lambda: _ids(8, 1), sw.ExampleInputsError, r"takes at least \[2\]"),
    "lengths-disagree": (lambda: {"input_ids": torch.randint(1, 128, (8, 10)), "labels": torch.randint(1, 128, (8, 9))},
                         sw.ExampleInputsError, r"stage \d+'s code cannot take \(ValueError: Expected input batch_size"),
}


@pytest.mark.parametrize(("make", "error", "phrase"), REFUSED.values(), ids=REFUSED.keys())
def test_shapes_the_pipeline_cannot_take_are_refused_before_the_step_and_change_nothing(make, error, phrase):
    pipe = _gpt2_pipe()
    before = {k: v.clone() for k, v in pipe.state_dict().items()}
    with pytest.raises(error, match=phrase):
        pipe.step(**make())
    assert_state_equal(pipe.state_dict(), before)
    pipe.step(**_ids(6, 9))  # and it trains on after


def test_a_fixed_width_is_refused_naming_the_stage_and_op():
    """fx code computes its sizes, but a Linear takes only its width: found on fake tensors, before the step."""
    torch.manual_seed(0)
    x, y = torch.randn(8, 8), torch.randint(0, 5, (8,))
    pipe = sw.compile(mlp(), 2, (x,), loss_fn=F.cross_entropy, example_target=y, microbatches=2, cost="analytic")
    with pytest.raises(sw.ExampleInputsError, match=r"input \[4, 7\].*stage 0's code cannot take"):
        pipe.step(torch.randn(8, 7), target=y)
    pipe.step(torch.randn(7, 8), target=y[:7])  # an uneven batch of the right width trains
