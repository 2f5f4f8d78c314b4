"""A run resumed from `pipe.save` / `sw.load` is bitwise the uninterrupted one, in one process, with
everything a real training loop has: dropout, AdamW with no-decay groups by name, warmup and
cosine on pipe.optimizer, gradient clipping; on the tied GPT and Hugging Face GPT-2, on 1, 2 and
4 devices. (Under two gloo ranks: tests/test_distributed_training_api.py.)

What a checkpoint must hold for that: the weights, the optimizer state and its learning rates, the
scheduler's state, and the step count, which with the plan's seed keys every dropout mask
(ir/random_streams.py). The user's global torch RNG is not part of it: the resumed run draws the
same masks with the global generator anywhere.
"""

from __future__ import annotations

import pytest
import torch

import stagewise as sw
from tests.training_problems import GROUPED, LR, batches_of, compiled, train_scheduled, warmup_cosine

SAVED_AFTER, RESUMED_FOR = 2, 2


@pytest.mark.parametrize("name", ["tied-gpt", "hf-gpt2"])
@pytest.mark.parametrize("devices", [1, 2, 4])
def test_resumed_run_is_bitwise_the_uninterrupted_one(tmp_path, name, devices):
    batches = batches_of(name, SAVED_AFTER + RESUMED_FOR)
    pipe = compiled(name, batches, "gpipe" if devices == 1 else "1f1b", optimizer=GROUPED, clip_grad_norm=0.5,
                    dropout=0.1, devices=devices)
    assert len(pipe.plan.stages) == devices
    sched = torch.optim.lr_scheduler.LambdaLR(pipe.optimizer, warmup_cosine)
    train_scheduled(pipe, sched, batches[:SAVED_AFTER])
    pipe.save(tmp_path / "ck", scheduler=sched, extra={"epoch": 3, "seen": [1, 2]})
    want = train_scheduled(pipe, sched, batches[SAVED_AFTER:])

    torch.manual_seed(12345)  # a fresh process's global generator: the resumed run must not depend on it
    loaded = sw.load(tmp_path / "ck")
    assert loaded._executor.state.iteration == SAVED_AFTER and loaded.extra == {"epoch": 3, "seen": [1, 2]}
    resumed = torch.optim.lr_scheduler.LambdaLR(loaded.optimizer, warmup_cosine)
    loaded.load_scheduler(resumed)
    torch.rand(7)
    got = train_scheduled(loaded, resumed, batches[SAVED_AFTER:])

    assert all(torch.equal(g[0], w[0]) for g, w in zip(got, want, strict=True)), (got, want)
    assert [g[1:] for g in got] == [w[1:] for w in want]  # gradient norms and learning rates
    assert [w[2] for w in want] == [[LR * warmup_cosine(s)] * 2 for s in range(SAVED_AFTER, SAVED_AFTER + RESUMED_FOR)]
    assert resumed.state_dict() == sched.state_dict()
    state = pipe.state_dict()
    for key, tensor in loaded.state_dict().items():
        assert torch.equal(tensor, state[key]), key
    assert repr(loaded.optimizer.state_dict()) == repr(pipe.optimizer.state_dict())


def test_the_step_count_keys_the_masks_of_a_resumed_run(tmp_path):
    """A checkpoint's step count is what makes the resumed masks those of the uninterrupted run:
    loaded with its step count set back to 0, the same weights draw other masks."""
    batches = batches_of("tied-gpt", SAVED_AFTER + 1)
    pipe = compiled("tied-gpt", batches, "1f1b", dropout=0.1)
    for batch in batches[:SAVED_AFTER]:
        pipe.step(*batch[0], target=batch[1])
    pipe.save(tmp_path / "ck")
    want = pipe.step(*batches[-1][0], target=batches[-1][1])
    loaded, restarted = sw.load(tmp_path / "ck"), sw.load(tmp_path / "ck")
    restarted._executor.state.iteration = 0
    assert torch.equal(loaded.step(*batches[-1][0], target=batches[-1][1]), want)
    assert not torch.equal(restarted.step(*batches[-1][0], target=batches[-1][1]), want)
