"""pipe.evaluate and the train/eval mode: a forward-only pass in eval mode equals eager
`model.eval()` under `torch.no_grad()` and changes nothing; train() after eval() trains again."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from transformers import GPT2Config, GPT2LMHeadModel

import stagewise as sw
from stagewise.ir.errors import ModeError, PredictError
from stagewise.ir.instructions import Backward, Forward, Recompute, Update
from tests.hf import bert, gpt2, llama, lm_batches
from tests.models.cnn import ResNet
from tests.models.dropout import DropoutGPT
from tests.models.gpt import lm_loss
from tests.reference import ADAMW, ATOL, RTOL, assert_state_equal

# (schedule, devices): each pipeline, stepped once, is evaluated and asked to predict; the two take turns
# at going first (the first builds the forward-only programs both run)
PLANS = [("gpipe", 1), ("gpipe", 2), ("1f1b", 2), ("varuna", 2), ("interleaved", 2), ("harmony-pp", 2),
         ("gpipe", 4), ("1f1b", 4), ("varuna", 4)]


def _tokens(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 64, (8, 16), generator=generator), torch.randint(0, 64, (8, 16), generator=generator)


def _eager_eval_loss(model, microbatches: int, loss_fn, inputs, target) -> torch.Tensor:
    model = copy.deepcopy(model).eval()
    with torch.no_grad():
        losses = [loss_fn(model(x), t) for x, t in zip(inputs.chunk(microbatches), target.chunk(microbatches), strict=True)]
    return torch.stack(losses).mean()


def _eager_predict(model, inputs) -> torch.Tensor:
    with torch.no_grad():
        return copy.deepcopy(model).eval()(inputs)


def _snapshot(pipe) -> tuple[dict[str, torch.Tensor], list, int]:
    state = {k: v.clone() for k, v in pipe.state_dict().items()}
    optimizers = [copy.deepcopy(w.optimizer.state_dict()) if w.optimizer else None for w in pipe._workers]
    return state, optimizers, pipe._executor.state.iteration


def _stepped_once(schedule: str, devices: int):
    """The dropout GPT compiled and stepped once (optimizer state and a step count to keep), the eager
    model holding the pipeline's weights, and the pipeline's state before what the test runs."""
    torch.manual_seed(0)
    model = DropoutGPT(p=0.3)
    inputs, target = _tokens()
    pipe = sw.compile(model, devices, (inputs,), loss_fn=lm_loss, example_target=target, microbatches=4,
                      schedule=schedule, cost="analytic", optimizer=ADAMW)
    pipe.step(inputs, target=target)
    model.load_state_dict(pipe.state_dict())
    return model, pipe, inputs, target, _snapshot(pipe)


def _assert_changed_nothing(pipe, before) -> None:
    """Weights, optimizer state and step count as after the one step; still in training mode."""
    state, optimizers, steps = _snapshot(pipe)
    assert_state_equal(state, before[0])
    assert steps == before[2] == 1
    for got, want in zip(optimizers, before[1], strict=True):
        assert repr(got) == repr(want)
    assert pipe.training  # evaluate and predict keep the mode step trains in


def _check_evaluate(model, pipe, inputs, target, before) -> None:
    loss = pipe.evaluate(inputs, target=target)
    torch.testing.assert_close(loss, _eager_eval_loss(model, 4, lm_loss, inputs, target), rtol=RTOL, atol=ATOL)
    _assert_changed_nothing(pipe, before)
    assert torch.equal(pipe.evaluate(inputs, target=target), loss)  # no random draw: the same again


def _check_predict(model, pipe, inputs, target, before) -> None:
    logits = pipe.predict(inputs)
    assert logits.device.type == "cpu" and logits.shape == (8, 16, 64)
    torch.testing.assert_close(logits, _eager_predict(model, inputs), rtol=RTOL, atol=ATOL)
    _assert_changed_nothing(pipe, before)


@pytest.mark.parametrize(("schedule", "devices"), PLANS)
def test_evaluate_and_predict_equal_eager_eval_and_change_nothing(schedule, devices):
    model, pipe, inputs, target, before = _stepped_once(schedule, devices)
    checks = [_check_evaluate, _check_predict]
    if PLANS.index((schedule, devices)) % 2:
        checks.reverse()
    for check in checks:
        check(model, pipe, inputs, target, before)


def test_forward_only_programs_hold_forwards_only():
    inputs, target = _tokens()
    pipe = sw.compile(DropoutGPT(), 2, (inputs,), loss_fn=lm_loss, example_target=target, microbatches=4,
                      schedule="varuna", cost="analytic")
    pipe.evaluate(inputs, target=target)
    programs = pipe._evaluation._executor.programs
    kinds = {type(i) for p in programs for i in p.instructions}
    assert not kinds & {Backward, Recompute, Update}
    forwards = [i for p in programs for i in p.instructions if isinstance(i, Forward)]
    assert len(forwards) == 4 * len(pipe.plan.stages) and not any(f.stash for f in forwards)


@pytest.mark.parametrize(("schedule", "devices"), [("gpipe", 2), ("varuna", 2), ("1f1b", 4)])
def test_batchnorm_evaluates_with_running_statistics(schedule, devices):
    torch.manual_seed(0)
    model = ResNet(blocks=2)
    images, labels = torch.randn(8, 3, 8, 8), torch.randint(0, 10, (8,))
    pipe = sw.compile(model, devices, (images,), loss_fn=F.cross_entropy, example_target=labels, microbatches=4,
                      schedule=schedule, cost="analytic", optimizer=ADAMW)
    for _ in range(2):
        pipe.step(images, target=labels)
    model.load_state_dict(pipe.state_dict())
    before = _snapshot(pipe)
    loss = pipe.evaluate(images, target=labels)
    torch.testing.assert_close(loss, _eager_eval_loss(model, 4, F.cross_entropy, images, labels), rtol=RTOL, atol=ATOL)
    assert_state_equal(_snapshot(pipe)[0], before[0])


def test_eval_mode_steps_without_dropout_and_train_turns_it_back_on():
    """Dropout's masks are keyed, so train mode is compared with the 1-device pipeline; eval mode
    with eager training of the same model in eval mode."""
    inputs, target = _tokens()
    losses = {}
    for devices in (1, 2):
        torch.manual_seed(0)
        pipe = sw.compile(DropoutGPT(p=0.3), devices, (inputs,), loss_fn=lm_loss, example_target=target,
                          microbatches=4, schedule="1f1b", cost="analytic", optimizer=ADAMW)
        assert pipe.eval() is pipe and not pipe.training
        off = pipe.step(inputs, target=target)
        on = pipe.train().step(inputs, target=target)
        losses[devices] = (off, on, pipe.state_dict())
    torch.manual_seed(0)
    eager = DropoutGPT(p=0.3).eval()
    torch.testing.assert_close(losses[2][0], _eager_eval_loss(eager, 4, lm_loss, inputs, target), rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(losses[2][1], losses[1][1], rtol=RTOL, atol=ATOL)
    assert_state_equal(losses[2][2], losses[1][2])
    assert not torch.equal(losses[2][1], _eager_eval_loss(eager, 4, lm_loss, inputs, target))


def test_model_compiled_in_eval_mode_starts_in_eval_mode():
    torch.manual_seed(0)
    inputs, target = _tokens()
    model = DropoutGPT(p=0.3).eval()
    pipe = sw.compile(model, 2, (inputs,), loss_fn=lm_loss, example_target=target, microbatches=4, cost="analytic")
    assert not pipe.training
    torch.testing.assert_close(pipe.evaluate(inputs, target=target), _eager_eval_loss(model, 4, lm_loss, inputs, target),
                               rtol=RTOL, atol=ATOL)
    with pytest.raises(ModeError, match="model.train\\(\\) before sw.compile"):
        pipe.train()  # its dropout was traced off: refused rather than training without dropout
    assert not pipe.training


def test_step_under_no_grad_is_refused():
    inputs, target = _tokens()
    pipe = sw.compile(DropoutGPT(), 2, (inputs,), loss_fn=lm_loss, example_target=target, microbatches=4, cost="analytic")
    with torch.no_grad(), pytest.raises(ModeError, match="pipe.evaluate"):
        pipe.step(inputs, target=target)
    assert pipe._executor.state.iteration == 0


@pytest.mark.parametrize("devices", [2, 4])
def test_huggingface_gpt2_evaluates_like_eager(devices):
    torch.manual_seed(0)
    config = GPT2Config(n_layer=4, n_embd=32, n_head=4, vocab_size=128, n_positions=32, bos_token_id=0,
                        eos_token_id=0, resid_pdrop=0.2, embd_pdrop=0.2, attn_pdrop=0.2)
    model = GPT2LMHeadModel(config)
    (batch, _), = lm_batches(steps=1)
    pipe = sw.compile(model, devices, batch, microbatches=4, cost="analytic")
    loss = pipe.evaluate(**batch)
    eager = copy.deepcopy(model).eval()
    with torch.no_grad():
        parts = [eager(input_ids=ids, labels=labels).loss
                 for ids, labels in zip(batch["input_ids"].chunk(4), batch["labels"].chunk(4), strict=True)]
    torch.testing.assert_close(loss, torch.stack(parts).mean(), rtol=RTOL, atol=ATOL)
    assert pipe.training and pipe._executor.state.iteration == 0


def test_predict_batchnorm_uses_running_statistics():
    torch.manual_seed(0)
    model = ResNet(blocks=2)
    images, labels = torch.randn(8, 3, 8, 8), torch.randint(0, 10, (8,))
    pipe = sw.compile(model, 2, (images,), loss_fn=F.cross_entropy, example_target=labels, microbatches=4,
                      schedule="1f1b", cost="analytic", optimizer=ADAMW)
    pipe.step(images, target=labels)
    model.load_state_dict(pipe.state_dict())
    before = _snapshot(pipe)
    torch.testing.assert_close(pipe.predict(images), _eager_predict(model, images), rtol=RTOL, atol=ATOL)
    assert_state_equal(_snapshot(pipe)[0], before[0])


@pytest.mark.parametrize(("build", "devices", "schedule"), [("gpt2", 1, "gpipe"), ("gpt2", 2, "1f1b"),
                                                           ("llama", 4, "varuna")])
def test_predict_gives_the_output_of_a_model_returning_its_own_loss(build, devices, schedule):
    """A Hugging Face model returns its loss (labels in the inputs): predict gives what it returns
    without labels, its ModelOutput with the `.logits` (the cache is not computed: left out), in eval
    mode (dropout off), for the example's shape, a shorter, smaller batch and one sample; nothing moves."""
    torch.manual_seed(0)
    model = (gpt2 if build == "gpt2" else llama)(2)
    ids = torch.randint(1, 100, (8, 12))
    pipe = sw.compile(model, devices, {"input_ids": ids, "labels": ids}, microbatches=4, schedule=schedule,
                      optimizer=ADAMW, cost="analytic")
    pipe.step(input_ids=ids, labels=ids)
    before = _snapshot(pipe)
    eager = copy.deepcopy(model)
    eager.load_state_dict(pipe.state_dict())
    for batch in (ids, ids[:6, :7], ids[:1]):
        with torch.no_grad():
            want = eager.eval()(input_ids=batch)
        for got in (pipe.predict(input_ids=batch, labels=batch), pipe.predict(input_ids=batch)):  # labels unread
            assert type(got) is type(want) and list(got.keys()) == ["logits"]
            torch.testing.assert_close(got.logits, want.logits, rtol=RTOL, atol=ATOL)
    assert_state_equal(_snapshot(pipe)[0], before[0])
    assert pipe._executor.state.iteration == before[2]


def _logits_loss(out, target: torch.Tensor) -> torch.Tensor:
    """A loss_fn reading `out.logits`, as one writes for a Hugging Face model."""
    return F.cross_entropy(out.logits.flatten(0, 1), target.flatten())


@pytest.fixture(scope="module")
def bert_with_loss_fn():
    torch.manual_seed(0)
    model = bert(2)
    ids = torch.randint(1, 100, (8, 12))
    pipe = sw.compile(model, 2, {"input_ids": ids}, loss_fn=_logits_loss, example_target=ids, microbatches=4,
                      cost="analytic")
    return model.eval(), pipe, ids


def test_predict_returns_the_model_output_a_loss_fn_reads(bert_with_loss_fn):
    """loss_fn reads `out.logits`: predict returns the MaskedLMOutput, for the batch and for one sample
    on 4 microbatches."""
    model, pipe, ids = bert_with_loss_fn
    for batch in (ids, ids[:1]):
        got = pipe.predict(input_ids=batch)
        with torch.no_grad():
            want = model(input_ids=batch)
        assert type(got) is type(want) and list(got.keys()) == list(want.keys()) == ["logits"]
        torch.testing.assert_close(got.logits, want.logits, rtol=RTOL, atol=ATOL)


def test_a_loaded_and_a_replanned_pipeline_predict_the_same_structure(bert_with_loss_fn, tmp_path):
    """The plan keeps the output's structure and nodes: sw.load (the saved plan) and a re-plan on 1 device."""
    model, pipe, ids = bert_with_loss_fn
    pipe.save(tmp_path / "ck")
    with torch.no_grad():
        want = model(input_ids=ids)
    for devices in (None, 1):
        loaded = sw.load(tmp_path / "ck", trusted_functions=[_logits_loss], devices=devices, report=False)
        got = loaded.predict(input_ids=ids)
        assert type(got) is type(want) and list(got.keys()) == ["logits"]
        torch.testing.assert_close(got.logits, want.logits, rtol=RTOL, atol=ATOL)


def test_evaluate_takes_one_sample_on_four_microbatches(bert_with_loss_fn):
    model, pipe, ids = bert_with_loss_fn
    one = ids[1:2]
    with torch.no_grad():
        want = _logits_loss(model(input_ids=one), one)
    torch.testing.assert_close(pipe.evaluate(input_ids=one, target=one), want, rtol=RTOL, atol=ATOL)


def test_predict_and_evaluate_name_themselves_in_their_errors(bert_with_loss_fn):
    _, pipe, ids = bert_with_loss_fn
    with pytest.raises(sw.ExampleInputsError, match="predict got 'input_ids' of dtype torch.float32"):
        pipe.predict(input_ids=ids.float())
    with pytest.raises(sw.ExampleInputsError, match="predict takes keyword inputs"):
        pipe.predict(ids)
    with pytest.raises(sw.ExampleInputsError, match=r"call evaluate\(\.\.\., target=targets\)"):
        pipe.evaluate(input_ids=ids)
    with pytest.raises(sw.BatchSizeError, match="evaluate got a batch of 7 for 'target'"):
        pipe.evaluate(input_ids=ids, target=ids[:7])


class _LogitsAndNorm(torch.nn.Module):
    """Returns a tuple, (logits, each sample's norm), which fx traces; its loss reads both."""

    def __init__(self):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16),
                                        torch.nn.ReLU(), torch.nn.Linear(16, 5))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.body(x)
        return logits, logits.norm(dim=1)


def _tuple_loss(out: tuple[torch.Tensor, torch.Tensor], target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out[0], target) + out[1].mean()


def test_predict_returns_a_tuple_and_evaluates_one_sample():
    torch.manual_seed(0)
    model = _LogitsAndNorm()
    x, y = torch.randn(8, 8), torch.randint(0, 5, (8,))
    pipe = sw.compile(model, 2, (x,), loss_fn=_tuple_loss, example_target=y, microbatches=4, cost="analytic")
    assert pipe.plan.tracer == "fx"
    for batch in (x, x[:1]):
        got = pipe.predict(batch)
        with torch.no_grad():
            want = model(batch)
        assert isinstance(got, tuple) and len(got) == 2
        torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)
    with torch.no_grad():
        torch.testing.assert_close(pipe.evaluate(x[:1], target=y[:1]), _tuple_loss(model(x[:1]), y[:1]),
                                   rtol=RTOL, atol=ATOL)


def test_predict_fills_in_only_inputs_it_does_not_read():
    """Labels only the loss reads may be left out; an attention mask, shaped like input_ids too, is
    read for its values: leaving it out is an error, never a silent mask of zeros."""
    torch.manual_seed(0)
    ids = torch.randint(1, 100, (8, 12))
    mask = torch.ones_like(ids)
    pipe = sw.compile(gpt2(2), 2, {"input_ids": ids, "attention_mask": mask, "labels": ids}, microbatches=4,
                      cost="analytic")
    assert pipe.predict(input_ids=ids, attention_mask=mask).logits.shape == (8, 12, 128)
    with pytest.raises(sw.ExampleInputsError, match="attention_mask"):
        pipe.predict(input_ids=ids, labels=ids)


def test_predict_without_a_known_output_is_refused():
    inputs, _ = _tokens()
    model = DropoutGPT()
    pipe = sw.compile(_OwnLoss(model), 2, (inputs, inputs), microbatches=4, cost="analytic")
    with pytest.raises(PredictError, match="loss_fn"):
        pipe.predict(inputs, inputs)


class _OwnLoss(torch.nn.Module):
    """A model that returns its own loss: its output is not a value predict can know."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return lm_loss(self.model(x), y)
