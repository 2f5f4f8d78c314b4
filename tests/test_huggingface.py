"""Real Hugging Face models from small configs (torch.export path) train exactly like eager."""

import pytest

from tests.hf import bert, gpt2, lm_batches
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
