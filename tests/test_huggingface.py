"""Real Hugging Face models from small configs (torch.export path) train exactly like eager."""

import pytest

from tests.hf import bert, gpt2, llama, lm_batches, t5
from tests.reference import ADAMW, SGD, check_equal_training


@pytest.mark.parametrize(
    ("devices", "microbatches", "optimizer", "clip", "schedule"),
    [(2, 2, SGD, None, "gpipe"), (4, 4, ADAMW, 1.0, "gpipe"), (3, 4, ADAMW, 1.0, "1f1b")],
)
def test_gpt2_lm_head(devices, microbatches, optimizer, clip, schedule):
    pipe = check_equal_training(gpt2(), lm_batches(), devices, optimizer=optimizer, microbatches=microbatches,
                                clip_grad_norm=clip, schedule=schedule)
    assert pipe.plan.tracer == "export"
    (tied,) = pipe.shared
    assert set(tied.names) == {"transformer.wte.weight", "lm_head.weight"}
    assert tied.stages == (0, devices - 1)


@pytest.mark.parametrize(("devices", "microbatches", "optimizer"), [(3, 4, SGD), (4, 2, ADAMW)])
def test_bert_masked_lm(devices, microbatches, optimizer):
    pipe = check_equal_training(bert(), lm_batches(), devices, optimizer=optimizer, microbatches=microbatches)
    names = {n for t in pipe.shared for n in t.names}
    assert {"bert.embeddings.word_embeddings.weight", "cls.predictions.decoder.weight"} <= names


@pytest.mark.parametrize(("devices", "schedule", "swap"), [(2, "1f1b", "off"), (3, "gpipe", "all"), (2, "harmony-pp", "on")])
def test_llama_causal_lm(devices, schedule, swap):
    """Its top-level submodule is named `model`: the capture must not shadow it."""
    pipe = check_equal_training(llama(), lm_batches(), devices, optimizer=ADAMW, microbatches=2, clip_grad_norm=1.0,
                                schedule=schedule, swap=swap)
    assert pipe.plan.tracer == "export"
    assert pipe.plan.layers[0].name.startswith("model.")


@pytest.mark.parametrize(("devices", "schedule"), [(2, "gpipe"), (3, "1f1b")])
def test_t5_encoder_decoder(devices, schedule):
    pipe = check_equal_training(t5(), lm_batches(), devices, optimizer=ADAMW, microbatches=2, schedule=schedule)
    names = {n for t in pipe.shared for n in t.names}
    assert {"shared.weight", "lm_head.weight"} <= names  # the tied embedding and head, summed before updates
