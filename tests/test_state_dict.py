"""`pipe.state_dict()` has every key of the model's own: unused layers and every alias of a tied or
reused module; `load_state_dict` is strict as torch's (unknown and missing keys, wrong shapes)."""

import pytest
import torch
import torch.nn as nn

import stagewise as sw
from stagewise.compiler.checkpoint.read import read_checkpoint
from tests.hf import gpt2, lm_batches
from tests.models.gpt import TinyGPT, lm_loss
from tests.reference import ADAMW, assert_state_equal, check_equal_training, pipeline_train, token_batches


class WithUnused(nn.Module):
    """A layer and a persistent buffer the loss never reaches (a head kept for later, say)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)
        self.spare = nn.Linear(8, 3)
        self.register_buffer("spare_scale", torch.full((3,), 2.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x))).pow(2).mean()


class Reused(nn.Module):
    """One Linear registered under two names and called at two depths (fx names it once)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.inner = nn.Sequential(nn.Linear(8, 8), nn.Tanh())
        self.mid = nn.Linear(8, 8)
        self.again = self.inner[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.mid(self.inner(self.a(x)))
        return self.again(x).pow(2).mean()


def batches(steps: int = 2) -> list:
    generator = torch.Generator().manual_seed(0)
    return [((torch.randn(8, 8, generator=generator),), None) for _ in range(steps)]


def compiled(model: nn.Module) -> sw.Pipeline:
    return sw.compile(model, 2, batches()[0][0], microbatches=2, cost="analytic", optimizer=ADAMW)


def clone(state: dict) -> dict:
    return {k: v.detach().clone() for k, v in state.items()}


@pytest.mark.parametrize("model", [WithUnused, Reused], ids=["unused", "reused"])
def test_state_dict_has_every_key_and_trains_equal_to_eager(model):
    torch.manual_seed(0)
    pipe = check_equal_training(model(), batches(), 2, microbatches=2, optimizer=ADAMW, cost="analytic")
    assert list(pipe.state_dict()) == list(model().state_dict())


def test_tied_gpt_state_dict_keys_are_the_models():
    batch = token_batches(1)[0]
    model = TinyGPT()
    pipe = sw.compile(model, 2, batch[0], loss_fn=lm_loss, example_target=batch[1], microbatches=2, cost="analytic")
    state = pipe.state_dict()
    assert list(state) == list(model.state_dict())
    torch.testing.assert_close(state["head.weight"], state["tok.weight"], rtol=0, atol=0)
    assert any(t.kind == "tied-parameter" for t in pipe.plan.shared)
    fresh = TinyGPT().state_dict()
    pipe.load_state_dict(fresh)
    for worker in pipe._workers:  # every stage's replica of the tied weight
        for name, tensor in worker.state_tensors().items():
            if name in fresh:  # not the blocks' non-persistent causal masks
                torch.testing.assert_close(tensor, fresh[name], rtol=0, atol=0, msg=name)


def test_hugging_face_gpt2_state_dict_keys_are_the_models():
    model = gpt2(2)
    inputs, _ = lm_batches(1)[0]
    pipe = sw.compile(model, 2, inputs, microbatches=2, cost="analytic")
    assert pipe.plan.tracer == "export"
    assert list(pipe.state_dict()) == list(model.state_dict())


def test_load_state_dict_round_trip_returns_no_incompatible_keys():
    pipe = compiled(WithUnused())
    fresh = WithUnused().state_dict()
    result = pipe.load_state_dict(fresh)
    assert result.missing_keys == [] and result.unexpected_keys == []
    assert_state_equal(pipe.state_dict(), fresh)


@pytest.mark.parametrize("change", ["extra", "missing", "shape"])
def test_a_bad_state_dict_names_the_key_and_loads_nothing(change):
    pipe = compiled(WithUnused())
    before = clone(pipe.state_dict())
    state = {k: torch.zeros_like(v) for k, v in before.items()}
    if change == "extra":
        state["c.weight"] = torch.zeros(8, 8)
    elif change == "missing":
        del state["spare.bias"]
    else:
        state["b.weight"] = torch.zeros(8)
    key = {"extra": "c.weight", "missing": "spare.bias", "shape": "b.weight"}[change]
    with pytest.raises(sw.StateDictError, match=f"'{key}'"):
        pipe.load_state_dict(state)
    assert_state_equal(pipe.state_dict(), before)


def test_a_wrong_shape_is_an_error_even_without_strict():
    pipe = compiled(WithUnused())
    state = clone(pipe.state_dict())
    state["spare.weight"] = torch.zeros(3)
    with pytest.raises(sw.StateDictError, match="'spare.weight'"):
        pipe.load_state_dict(state, strict=False)


def test_not_strict_loads_what_matches_and_reports_the_rest():
    pipe = compiled(WithUnused())
    before = clone(pipe.state_dict())
    fresh = WithUnused().state_dict()
    partial = {"a.weight": fresh["a.weight"], "spare.bias": fresh["spare.bias"], "other": torch.zeros(1)}
    result = pipe.load_state_dict(partial, strict=False)
    assert result.unexpected_keys == ["other"]
    assert set(result.missing_keys) == set(before) - {"a.weight", "spare.bias"}
    after = pipe.state_dict()
    torch.testing.assert_close(after["a.weight"], fresh["a.weight"], rtol=0, atol=0)
    torch.testing.assert_close(after["spare.bias"], fresh["spare.bias"], rtol=0, atol=0)
    torch.testing.assert_close(after["b.weight"], before["b.weight"], rtol=0, atol=0)


def test_one_name_of_a_tied_weight_is_enough_but_two_values_are_an_error():
    pipe = compiled(Reused())
    fresh = Reused().state_dict()
    one_name = {k: v for k, v in fresh.items() if not k.startswith("again.")}
    assert pipe.load_state_dict(one_name).missing_keys == []
    torch.testing.assert_close(pipe.state_dict()["again.weight"], fresh["inner.0.weight"], rtol=0, atol=0)
    fresh["again.weight"] = fresh["again.weight"] + 1
    with pytest.raises(sw.StateDictError, match="'again.weight'"):
        pipe.load_state_dict(fresh)


def test_save_load_keeps_the_unused_state(tmp_path):
    pipe = compiled(WithUnused())
    pipeline_train(pipe, batches())
    changed = clone(pipe.state_dict())
    changed["spare.weight"] += 1  # the unused layer's value goes through load_state_dict and save
    pipe.load_state_dict(changed)
    pipe.save(tmp_path / "ck")
    assert "model.spare.weight" in read_checkpoint(tmp_path / "ck", None).tensors
    loaded = sw.load(tmp_path / "ck")
    assert list(loaded.state_dict()) == list(WithUnused().state_dict())
    assert_state_equal(loaded.state_dict(), changed)
    more = batches(1)
    torch.testing.assert_close(torch.stack(pipeline_train(loaded, more)), torch.stack(pipeline_train(pipe, more)),
                               rtol=0, atol=0)
