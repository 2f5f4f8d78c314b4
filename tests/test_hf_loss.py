"""A Hugging Face model returning its own loss over padded labels trains like eager on the whole batch
with no loss_reduction given: its token mean, counted as its Trainer counts `num_items_in_batch`."""

import copy
import warnings

import pytest
import torch

import stagewise as sw
from stagewise.compiler.assembly.loss_reduction import model_reduction
from tests.hf import bert, gpt2, llama, t5
from tests.models.gpt import TinyGPT
from tests.reference import SGD, assert_state_equal

MICROBATCHES, STEPS = 4, 3


def padded_batches(steps: int = STEPS, batch: int = 8, length: int = 10) -> list[dict[str, torch.Tensor]]:
    """Keyword batches whose labels hold -100 at each row's end (padding, masked out) and over a
    prompt at its start, of random lengths: every microbatch counts a different number of tokens."""
    generator = torch.Generator().manual_seed(3)
    out = []
    for _ in range(steps):
        ids = torch.randint(1, 128, (batch, length), generator=generator)
        kept = torch.randint(2, length + 1, (batch,), generator=generator)
        prompt = torch.randint(0, 4, (batch,), generator=generator)
        positions = torch.arange(length)
        mask = (positions < kept[:, None]).long()
        labels = ids.masked_fill((mask == 0) | (positions < prompt[:, None]), -100)
        out.append({"input_ids": ids, "attention_mask": mask, "labels": labels})
    return out


def eager_whole_batch(model: torch.nn.Module, batches: list[dict]) -> list[torch.Tensor]:
    """Eager training, one forward over the whole batch per step: the reference."""
    opt = SGD(model.parameters())
    losses = []
    for batch in batches:
        opt.zero_grad()
        loss = model(**batch).loss
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return losses


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def trained(request):
    """A pipeline trained on padded batches with no loss_reduction, beside eager on the whole batch."""
    model = {"gpt2": gpt2, "llama": llama}[request.param](layers=2)
    reference = copy.deepcopy(model)
    batches = padded_batches()
    pipe = sw.compile(model, 2, batches[0], optimizer=SGD, microbatches=MICROBATCHES, schedule="1f1b", cost="analytic")
    with warnings.catch_warnings():
        warnings.simplefilter("error", sw.UnweightedLossWarning)
        losses = [pipe.step(**batch) for batch in batches]
    return pipe, torch.stack(losses), reference, torch.stack(eager_whole_batch(reference, batches))


def test_microbatches_count_different_tokens():
    """The case the default must get right: a mean of microbatch means would differ."""
    for batch in padded_batches():
        counts = {int((labels[:, 1:] != -100).sum()) for labels in batch["labels"].tensor_split(MICROBATCHES)}
        assert len(counts) > 1


def test_causal_lm_defaults_to_its_shifted_token_mean(trained):
    pipe, *_ = trained
    assert pipe.loss_reduction == sw.TokenMean(ignore_index=-100, labels="labels", shift=True)


def test_losses_and_weights_equal_eager_on_the_whole_batch(trained):
    pipe, got, reference, want = trained
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert_state_equal(pipe.state_dict(), reference.state_dict())


@pytest.mark.parametrize(("make", "names", "want"), [
    (gpt2, ["input_ids", "labels"], sw.TokenMean(labels="labels", shift=True)),  # loss_type None: ForCausalLMLoss
    (bert, ["input_ids", "labels"], sw.TokenMean(labels="labels", shift=False)),  # masked LM: every label a target
    (t5, ["input_ids", "labels"], sw.TokenMean(labels="labels", shift=False)),  # encoder-decoder: unshifted
    (gpt2, ["input_ids"], None),  # no labels: no loss of its own to count
    (TinyGPT, ["ids", "labels"], None),  # not a Hugging Face model: its loss is unknown
])
def test_default_reduction_is_the_models_own(make, names, want):
    assert model_reduction(make(layers=1), names) == want
