"""compile's shape_buckets: a step's sequences padded at the end up to a bucket train exactly as
eager on the unpadded batches (targets padded with the ignore index, an attention mask with 0);
padding a model would read is refused at compile, naming the input; bad values are refused.
"""

from __future__ import annotations

import copy
import io

import pytest
import torch
import torch.nn.functional as F

import stagewise as sw
from stagewise.compiler.compile import driver
from tests.harness.any_shape import eager_split_train, train_steps
from tests.harness.crafted import quiet_load, reseal
from tests.hf import bert, llama
from tests.models.gpt import TinyGPT
from tests.reference import ATOL, RTOL, SGD, assert_state_equal

LENGTHS = (12, 7, 10, 5, 3)  # the example first; bucketed by 4 to 12, 8, 12, 8, 4


def _causal_batches() -> list:
    generator = torch.Generator().manual_seed(0)
    batches = []
    for length in LENGTHS:
        ids = torch.randint(1, 128, (8, length), generator=generator)
        batches.append(({"input_ids": ids, "labels": ids.clone()}, None))
    return batches


def _masked_lm_batches() -> list:
    """BERT's masked LM: labels -100 but where a token is to be predicted; every token attended."""
    generator = torch.Generator().manual_seed(0)
    batches = []
    for length in LENGTHS:
        ids = torch.randint(1, 128, (8, length), generator=generator)
        labels = torch.where(torch.rand(8, length, generator=generator) < 0.3, ids, torch.full_like(ids, -100))
        labels[:, 0] = ids[:, 0]  # every microbatch counts some
        batches.append(({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}, None))
    return batches


CASES = {"causal-llama": (llama, _causal_batches, 4), "masked-bert": (bert, _masked_lm_batches, (4, 8))}


@pytest.mark.parametrize(("build", "make_batches", "buckets"), CASES.values(), ids=CASES.keys())
def test_bucketed_steps_train_as_eager_on_the_unpadded_batches(build, make_batches, buckets):
    """The causal model needs no mask (real positions never see later ones); the bidirectional one
    is kept from the padding by its attention mask. Only bucket lengths reach the stages."""
    torch.manual_seed(0)
    model = build(2)
    reference = copy.deepcopy(model)
    batches = make_batches()
    pipe = sw.compile(model, 2, batches[0][0], microbatches=2, optimizer=SGD, cost="analytic",
                      training=sw.TrainingOptions(shape_buckets=buckets))
    got = train_steps(pipe, batches)
    want = eager_split_train(reference, batches, microbatches=1, optimizer=SGD)
    torch.testing.assert_close(torch.stack(got), torch.stack(want), rtol=RTOL, atol=ATOL)
    assert_state_equal(pipe.state_dict(), reference.state_dict())
    assert {size[1] for signature in pipe._feeding.step_shapes.cache for _, size, _ in signature} == {4, 8}
    inputs = batches[1][0]  # evaluate pads too: the loss of the unpadded batch
    reference.eval()
    with torch.no_grad():
        want_loss = reference(**inputs).loss
    torch.testing.assert_close(pipe.evaluate(**inputs), want_loss, rtol=RTOL, atol=ATOL)


def test_an_unmasked_bidirectional_model_is_refused_naming_the_input():
    """BERT without an attention mask attends to the padding: the loss would change."""
    torch.manual_seed(0)
    inputs = {k: v for k, v in _masked_lm_batches()[0][0].items() if k != "attention_mask"}
    with pytest.raises(sw.OptionError, match="pads input 'input_ids', and the model reads its padding.*attention"):
        sw.compile(bert(2), 2, inputs, microbatches=2, cost="analytic", shape_buckets=8)


def _summed_over_positions(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """A token loss divided by every position, padding included: it depends on the length."""
    return F.cross_entropy(logits.flatten(0, 1), target.flatten(), reduction="sum") / target.numel()


def test_a_loss_that_counts_the_padding_is_refused_naming_the_target():
    torch.manual_seed(0)
    ids = torch.randint(0, 64, (8, 13))
    with pytest.raises(sw.OptionError, match=r"the loss counts the padding of \['target'\]"):
        sw.compile(TinyGPT(), 2, (ids[:, :-1],), loss_fn=_summed_over_positions, example_target=ids[:, 1:],
                   microbatches=2, cost="analytic", shape_buckets=(4, 8))


BAD = {"zero": 0, "negative": -4, "bool": True, "string": "16", "float": 2.5, "empty": [], "repeated": [8, 8],
       "non-positive-length": [0, 8]}


@pytest.mark.parametrize("value", BAD.values(), ids=BAD.keys())
def test_bad_shape_buckets_are_refused_where_written(value):
    with pytest.raises(sw.OptionError, match="shape_buckets=.*e.g. shape_buckets=16"):
        sw.TrainingOptions(shape_buckets=value)


def test_a_bucket_longer_than_the_example_or_an_input_without_a_sequence_is_refused_before_compiling(monkeypatch):
    monkeypatch.setattr(driver, "run_checked", None)  # nothing is compiled
    with pytest.raises(sw.OptionError, match=r"shape_buckets lists \[16\], longer than the example's sequence \(12\)"):
        sw.compile(llama(1), 1, _causal_batches()[0][0], microbatches=1, cost="analytic", shape_buckets=[8, 16])
    with pytest.raises(sw.OptionError, match=r"pads dimension 1 \(the sequence\), but input 'x' is \[8\]"):
        sw.compile(torch.nn.Linear(1, 1), 1, {"x": torch.randn(8)}, microbatches=1, cost="analytic", shape_buckets=4)


def test_a_resized_pipeline_still_pads():
    """pipe.resize rebuilds the runtime from a checkpoint: the padding is the compiled pipeline's and stays."""
    torch.manual_seed(0)
    batches = _causal_batches()
    pipe = sw.compile(llama(1), ["cpu"], batches[0][0], microbatches=2, cost="analytic", virtual_devices=2,
                      shape_buckets=4)
    pipe.resize(["cpu", "cpu"])
    pipe.step(**batches[1][0])  # 7 tokens: padded to 8
    assert {size[1] for signature in pipe._feeding.step_shapes.cache for _, size, _ in signature} == {8}


def _step_lengths(pipe: sw.Pipeline) -> set[int]:
    return {size[1] for signature in pipe._feeding.step_shapes.cache for _, size, _ in signature}


def test_a_loaded_pipeline_pads_as_the_saved_one_and_trains_as_it_would_have(tmp_path):
    """The checkpoint keeps compile's shape_buckets: a loaded pipeline padded nothing before (each new
    length its own shape), so the buckets a user chose were lost on every resume. A crafted padding
    longer than the plan's example is refused: it would allocate what was never planned."""
    torch.manual_seed(0)
    batches = _causal_batches()
    pipe = sw.compile(llama(1), 2, batches[0][0], microbatches=2, optimizer=SGD, cost="analytic", shape_buckets=4)
    train_steps(pipe, batches[:2])
    pipe.save(tmp_path / "bucketed")
    loaded = quiet_load(tmp_path / "bucketed")
    torch.testing.assert_close(torch.stack(train_steps(loaded, batches[2:])),
                               torch.stack(train_steps(pipe, batches[2:])), rtol=0, atol=0)
    assert_state_equal(loaded.state_dict(), pipe.state_dict())
    assert _step_lengths(loaded) == {8, 4}  # 5 and 3 tokens bucketed by 4 (10 to the example's 12, not cached)
    training = torch.load(tmp_path / "bucketed" / "training.pt", weights_only=True)
    buffer = io.BytesIO()
    torch.save({**training, "padding": {**training["padding"], "multiple": 10 ** 9, "longest": 10 ** 9}}, buffer)
    (tmp_path / "bucketed" / "training.pt").write_bytes(buffer.getvalue())
    reseal(tmp_path / "bucketed")
    with pytest.raises(sw.CheckpointError, match="training.pt gives padding=.*other than the plan's inputs of that"):
        quiet_load(tmp_path / "bucketed")
