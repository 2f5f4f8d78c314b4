"""A declared loss reduction makes a step equal eager training on the whole batch when padding gives
microbatches different numbers of counted tokens; without one the step stays the mean of means."""

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F

import stagewise as sw
from stagewise.compiler.assembly.loss_reduction import padding_without_reduction
from stagewise.compiler.pipeline.step_notices import StepNotices
from tests.models.gpt import TinyGPT, lm_loss
from tests.reference import SGD, assert_state_equal, eager_train, pipeline_train

MICROBATCHES = 4


def padded_batches(steps=2, batch=8, length=8, empty_microbatch=False):
    """Next-token batches whose targets end in -100 padding of a different length per row; with
    `empty_microbatch` the first microbatch (2 rows) counts no token at all."""
    out = []
    for _ in range(steps):
        ids = torch.randint(0, 64, (batch, length + 1))
        target = ids[:, 1:].clone()
        for row, kept in enumerate(torch.randint(1, length + 1, (batch,)).tolist()):
            target[row, kept:] = -100
        if empty_microbatch:
            target[: batch // MICROBATCHES] = -100
        out.append(((ids[:, :-1],), target))
    return out


def whole_batch_train(model, batches, loss_of):
    """Eager training, one loss over the whole batch per step."""
    opt = SGD(model.parameters())
    losses = []
    for inputs, target in batches:
        opt.zero_grad()
        loss = loss_of(model, inputs, target)
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return losses


def check_whole_batch(model, batches, devices, schedule, loss_of, **compile_kwargs):
    reference = copy.deepcopy(model)
    inputs, target = batches[0]
    pipe = sw.compile(model, devices, inputs, optimizer=SGD, microbatches=MICROBATCHES, schedule=schedule,
                      cost="analytic", **compile_kwargs)
    got = pipeline_train(pipe, batches)
    want = whole_batch_train(reference, batches, loss_of)
    torch.testing.assert_close(torch.stack(got), torch.stack(want), rtol=1e-5, atol=1e-6)
    assert_state_equal(pipe.state_dict(), reference.state_dict())


def _lm_loss_of(model, inputs, target):
    return lm_loss(model(*inputs), target)


@pytest.mark.parametrize("devices", [2, 4])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "varuna"])
def test_token_mean_equals_whole_batch(devices, schedule):
    check_whole_batch(TinyGPT(), padded_batches(), devices, schedule, _lm_loss_of, loss_fn=lm_loss,
                      example_target=padded_batches(1)[0][1], loss_reduction=sw.TokenMean(ignore_index=-100))


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_microbatch_without_counted_tokens_contributes_nothing(schedule):
    batches = padded_batches(empty_microbatch=True)
    check_whole_batch(TinyGPT(), batches, 2, schedule, _lm_loss_of, loss_fn=lm_loss, example_target=batches[0][1],
                      loss_reduction=sw.TokenMean())


def test_sample_mean_of_equal_microbatches_is_the_mean_of_means():
    batches = padded_batches()
    model = TinyGPT()
    reference = copy.deepcopy(model)
    pipe = sw.compile(model, 2, batches[0][0], loss_fn=lm_loss, example_target=batches[0][1], optimizer=SGD,
                      microbatches=MICROBATCHES, cost="analytic", loss_reduction=sw.SampleMean())
    got = pipeline_train(pipe, batches)
    want = eager_train(reference, batches, loss_fn=lm_loss, microbatches=MICROBATCHES)
    torch.testing.assert_close(torch.stack(got), torch.stack(want), rtol=1e-5, atol=1e-6)
    assert_state_equal(pipe.state_dict(), reference.state_dict())


def test_default_keeps_the_mean_of_microbatch_means_and_says_so_once():
    """A loss_fn's reduction is unknown: padded targets keep the mean of means, with one warning
    per pipeline naming the fix."""
    batches = padded_batches()
    model = TinyGPT()
    reference, whole = copy.deepcopy(model), copy.deepcopy(model)
    pipe = sw.compile(model, 2, batches[0][0], loss_fn=lm_loss, example_target=batches[0][1], optimizer=SGD,
                      microbatches=MICROBATCHES, cost="analytic")
    assert pipe.loss_reduction is None
    with pytest.warns(sw.UnweightedLossWarning, match=r"loss_reduction=sw.TokenMean\(ignore_index=-100\)") as caught:
        got = torch.stack(pipeline_train(pipe, batches))
    assert len([w for w in caught if w.category is sw.UnweightedLossWarning]) == 1
    torch.testing.assert_close(got, torch.stack(eager_train(reference, batches, loss_fn=lm_loss,
                                                            microbatches=MICROBATCHES)), rtol=1e-5, atol=1e-6)
    assert_state_equal(pipe.state_dict(), reference.state_dict())
    assert not torch.allclose(got, torch.stack(whole_batch_train(whole, batches, _lm_loss_of)))


@pytest.fixture(scope="module")
def unreduced():
    """A loss_fn pipeline compiled without a loss_reduction, for the cases that must not warn."""
    (ids,), target = padded_batches(steps=1)[0]
    return sw.compile(TinyGPT(layers=2), 2, (ids,), loss_fn=lm_loss, example_target=target, microbatches=2,
                      schedule="gpipe", cost="analytic"), ids, target


@pytest.mark.parametrize("case", ["no-padding", "reduction-given"])
def test_no_warning_where_the_mean_of_means_is_eager_or_declared(unreduced, case):
    pipe, ids, target = unreduced
    pipe._notices, pipe.loss_reduction = StepNotices(), None  # as compiled: nothing warned yet
    if case == "no-padding":
        target = target.masked_fill(target == -100, 0)
    else:
        pipe.loss_reduction = sw.TokenMean()
    with warnings.catch_warnings():
        warnings.simplefilter("error", sw.UnweightedLossWarning)
        pipe.step(ids, target=target)


def test_a_float_target_of_minus_100_is_a_value_not_padding():
    assert padding_without_reduction({"target": torch.full((4,), -100.0)}, "target") is None
    assert "sw.TokenMean(ignore_index=-100)" in padding_without_reduction({"target": torch.full((4,), -100)}, "target")


def test_model_returning_its_loss_from_padded_labels_warns():
    """Not a Hugging Face model: the reduction of its own loss is unknown, so the step says so."""
    batches = _causal_batches(1)
    pipe = sw.compile(_CausalLM(), 2, batches[0][0], microbatches=2, cost="analytic")
    assert pipe.loss_reduction is None
    with pytest.warns(sw.UnweightedLossWarning, match=r"'labels'.*sw.TokenMean\(labels='labels', shift=True\)"):
        pipeline_train(pipe, batches)


class _CausalLM(torch.nn.Module):
    """A model returning its own loss from `labels`, as Hugging Face causal LMs do (shifted)."""

    def __init__(self):
        super().__init__()
        self.gpt = TinyGPT()

    def forward(self, ids, labels):
        logits = self.gpt(ids)
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())


def _causal_batches(steps=2):
    out = []
    for (ids,), target in padded_batches(steps):
        labels = torch.cat([ids[:, :1], target[:, :-1]], dim=1)  # labels[:, 1:] are the next tokens
        out.append(((ids, labels), None))
    return out


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_model_returning_its_loss_with_labels(schedule):
    check_whole_batch(_CausalLM(), _causal_batches(), 2, schedule, lambda m, inputs, _: m(*inputs),
                      loss_reduction=sw.TokenMean(labels="labels", shift=True))


def test_model_returning_its_loss_needs_labels_named():
    with pytest.raises(sw.LossError, match="needs labels= naming the model input"):
        sw.compile(_CausalLM(), 2, _causal_batches(1)[0][0], microbatches=2, cost="analytic",
                   loss_reduction=sw.TokenMean())


def test_a_loaded_pipeline_keeps_the_reduction_and_trains_on_alike(tmp_path):
    """The reduction is part of the checkpoint: a loaded pipeline's steps equal the saved one's."""
    batches = padded_batches(steps=3)
    inputs, target = batches[0]
    reduction = sw.TokenMean(ignore_index=-100)
    pipe = sw.compile(TinyGPT(), 2, inputs, optimizer=SGD, loss_fn=lm_loss, example_target=target,
                      microbatches=MICROBATCHES, schedule="1f1b", cost="analytic", loss_reduction=reduction)
    pipeline_train(pipe, batches[:1])
    pipe.save(tmp_path / "ckpt")
    loaded = sw.load(tmp_path / "ckpt")
    assert loaded.loss_reduction == reduction
    want, got = pipeline_train(pipe, batches[1:]), pipeline_train(loaded, batches[1:])
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert_state_equal(loaded.state_dict(), pipe.state_dict())
