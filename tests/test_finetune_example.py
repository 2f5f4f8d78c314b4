"""examples/finetune.py, run on a tiny GPT-2, trains as the same loop written in eager PyTorch.

The eager loop below is the example's loop without stagewise: the same model init, data order,
collate_fn, no-decay groups, warmup + cosine schedule, clipping and validation, with
`torch.autocast` for bf16, on the whole padded batch at once (TokenMean makes the pipeline's loss
that batch's token mean, so microbatching needs no counterpart here).

Dropout: the pipeline draws each mask from a stream keyed by (seed, step, op, microbatch), eager
from its one global generator (README "Randomness"): with dropout on, the two runs train different
networks from the first step, and no tolerance on their difference tells a bug from other masks.
So the exact comparison runs the example with dropout 0.0 in fp32 (losses, learning rates, gradient
norms and validation losses to ~1e-5), and the example's own settings (dropout 0.1, bf16) are
compared with a band: eager runs with other dropout seeds show how far other masks move the curve,
and the pipeline's curve must lie within that band of eager's. Resuming is checked on both:
a run resumed from a middle checkpoint equals the uninterrupted run bitwise.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from torch.utils.data import DataLoader

import examples.finetune as finetune
from examples.finetune import FinetuneConfig, History

STEPS, SAVE_AT = 7, 3


def tiny_config(tmp_path, **changes) -> FinetuneConfig:
    """The example's loop on the tiny preset: 7 steps over two epochs of 8, 8, 8 and 5 sequences
    (the short last batch is step 4: microbatches of 2, 1, 1, 1), sequence lengths 6 to 20 padded
    per batch, validation after steps 4 and 7 (13 sequences: 8 and 5), checkpoints after 3 and 6."""
    config = FinetuneConfig(size="tiny", batch_size=8, min_length=6, max_length=20, train_sequences=29,
                            validation_sequences=13, steps=STEPS, warmup_steps=2, eval_every=4, save_every=SAVE_AT,
                            checkpoint=tmp_path / "checkpoints", quiet=True)
    return dataclasses.replace(config, **changes)


def eager_finetune(config: FinetuneConfig, dropout_seed: int = 0) -> History:
    """The example's loop in plain PyTorch on one device; `dropout_seed` seeds eager's masks."""
    model = finetune.build_model(config)
    named = list(model.named_parameters())
    by_name = dict(named)
    groups = [{**g, "params": [by_name[n] for n in g["params"]]} for g in finetune.no_decay_groups(named)]
    optimizer = torch.optim.AdamW(groups, lr=config.lr, weight_decay=config.weight_decay)
    scheduler = finetune.schedule(optimizer, config)
    train_set = finetune.synthetic_corpus(config.train_sequences, config, seed=config.seed)
    validation = DataLoader(finetune.synthetic_corpus(config.validation_sequences, config, seed=config.seed + 10_000),
                            batch_size=config.batch_size, collate_fn=finetune.pad_batch)
    bf16 = config.precision == "bf16"
    torch.manual_seed(dropout_seed)
    history = History()
    for step, batch in finetune.train_batches(train_set, config, 0):
        history.steps.append(step)
        history.lrs.append(scheduler.get_last_lr()[0])
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = model(**batch).loss
        loss.backward()
        history.grad_norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), config.clip_grad_norm)))
        optimizer.step()
        scheduler.step()
        history.losses.append(float(loss))
        done = step + 1
        if done % config.eval_every == 0 or done == config.steps:
            history.validation[done] = _eager_validation(model, validation, bf16)
    return history


def _eager_validation(model, loader, bf16: bool) -> float:
    model.eval()
    total = tokens = 0.0
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        for batch in loader:
            count = finetune.counted_tokens(batch)
            total += float(model(**batch).loss) * count
            tokens += count
    model.train()
    return total / tokens


def _uninterrupted_and_resumed(config: FinetuneConfig) -> tuple[History, History]:
    _, whole = finetune.finetune(config)
    _, resumed = finetune.finetune(dataclasses.replace(config, resume=config.checkpoint / f"step-{SAVE_AT}"))
    return whole, resumed


def _assert_resumed_bitwise(whole: History, resumed: History) -> None:
    assert resumed.steps == whole.steps[SAVE_AT:]
    assert resumed.losses == whole.losses[SAVE_AT:]
    assert resumed.lrs == whole.lrs[SAVE_AT:]
    assert resumed.grad_norms == whole.grad_norms[SAVE_AT:]
    assert resumed.validation == {s: v for s, v in whole.validation.items() if s > SAVE_AT}


# bf16 against eager autocast: bf16 keeps 8 significant bits (a value rounds by up to 2^-9 = 2e-3
# relative), and the pipeline's microbatches run other matmul shapes than eager's whole batch, so
# the two may round logits and gradients differently, each rounding a random sign averaging out over
# the batch's tokens. Measured on this model, rounding everything to bf16 or not (eager autocast
# against eager fp32) moves the loss by at most 1.5e-4 (3e-5 relative) and the gradient norm by
# 1.1e-3 relative; the bound, 5e-4 relative (5x that for gradient norms), is 16x the first, while
# a wrong loss weighting or a dropout mask (1e-3 and more on a loss of 4.8) fails. fp32: 1e-5.
TOLERANCES = [pytest.param("fp32", 1e-5, id="fp32"),
              pytest.param("bf16", 5e-4, id="bf16")]


@pytest.mark.parametrize(("precision", "rel"), TOLERANCES)
def test_example_without_dropout_equals_eager_pytorch(tmp_path, precision, rel):
    config = tiny_config(tmp_path, precision=precision, dropout=0.0)
    shapes = [tuple(batch["input_ids"].shape) for _, batch in finetune.train_batches(
        finetune.synthetic_corpus(config.train_sequences, config, seed=config.seed), config, 0)]
    assert [rows for rows, _ in shapes] == [8, 8, 8, 5, 8, 8, 8] and len({length for _, length in shapes}) > 2
    whole, resumed = _uninterrupted_and_resumed(config)
    eager = eager_finetune(config)
    assert whole.steps == list(range(STEPS))
    assert whole.lrs == pytest.approx(eager.lrs, rel=1e-12)
    assert whole.losses == pytest.approx(eager.losses, rel=rel, abs=1e-6)
    assert whole.grad_norms == pytest.approx(eager.grad_norms, rel=5 * rel, abs=1e-6)
    assert whole.validation.keys() == eager.validation.keys() == {4, STEPS}
    assert list(whole.validation.values()) == pytest.approx(list(eager.validation.values()), rel=rel, abs=1e-6)
    _assert_resumed_bitwise(whole, resumed)


def test_example_as_shipped_trains_within_the_spread_of_eager_dropout(tmp_path):
    """bf16 and dropout 0.1: the pipeline's masks are not eager's, so its curve is compared with
    the spread that other masks give eager's (4 dropout seeds), and dropout must be drawing."""
    config = tiny_config(tmp_path)
    assert (config.precision, config.dropout) == ("bf16", 0.1)  # the example's defaults
    whole, resumed = _uninterrupted_and_resumed(config)
    _assert_resumed_bitwise(whole, resumed)
    eager = [eager_finetune(config, dropout_seed=seed) for seed in range(4)]
    without_dropout = eager_finetune(dataclasses.replace(config, dropout=0.0))
    spread = max(max(run.losses[i] for run in eager) - min(run.losses[i] for run in eager) for i in range(STEPS))
    assert spread > 1e-3  # other masks move eager's curve by far more than bf16's rounding
    assert abs(whole.losses[0] - without_dropout.losses[0]) > 1e-3  # the same weights: the masks made it
    for i in range(STEPS):
        assert math.isfinite(whole.losses[i])
        assert abs(whole.losses[i] - eager[0].losses[i]) <= 3 * spread, (i, whole.losses, [r.losses for r in eager])
    for step, loss in whole.validation.items():
        assert abs(loss - eager[0].validation[step]) <= 3 * spread
