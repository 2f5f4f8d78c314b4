"""`pipe.optimizer` as one torch optimizer over the model: LR schedulers on it, parameter groups by
name (`stagewise.ParamGroups`), state_dict by the model's names, `pipe.last_grad_norm`, and a
scheduler that resumes bitwise across `pipe.save` / `sw.load`; each against eager PyTorch."""

import copy
import math

import pytest
import torch

import stagewise as sw
from tests.models.gpt import TinyGPT, lm_loss
from tests.reference import ATOL, RTOL, assert_state_equal, eager_train, token_batches

LR = 1e-2


def warmup_cosine(step: int) -> float:
    """Linear warmup over 2 steps, then a cosine decay over 6."""
    if step < 2:
        return (step + 1) / 2
    return 0.5 * (1 + math.cos(math.pi * min(step - 2, 6) / 6))


def halving(step: int) -> float:
    return 0.5 ** step


def no_decay_groups(named: list) -> list[dict]:
    """Hugging Face Trainer's grouping: no weight decay on biases and norm weights."""
    no_decay = [p for n, p in named if n.endswith(".bias") or ".ln" in n or n.startswith("ln_f")]
    decay = [p for n, p in named if not any(p is q for q in no_decay)]
    return [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]


def by_names_groups(named: list) -> list[dict]:
    """Groups that list names, with a learning rate of their own."""
    return [{"params": [n for n, _ in named if "blocks" in n], "lr": LR / 2},
            {"params": [n for n, _ in named if "blocks" not in n]}]


def partial_groups(named: list) -> list[dict]:
    return [{"params": [p for n, p in named if "blocks" in n]}]


def overlapping_groups(named: list) -> list[dict]:
    return [{"params": [p for _, p in named]}, {"params": [named[0][1]]}]


def unknown_groups(named: list) -> list[dict]:
    return [{"params": ["nope"]}]


def adamw(params):
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.1, eps=1e-4)


GROUPED = sw.ParamGroups(torch.optim.AdamW, no_decay_groups, lr=LR, eps=1e-4)


def eager_optimizer(model: torch.nn.Module, optimizer) -> torch.optim.Optimizer:
    if isinstance(optimizer, sw.ParamGroups):
        return optimizer.optimizer_class(optimizer.groups(list(model.named_parameters())), **optimizer.defaults)
    return optimizer(model.parameters())


def eager_run(model, batches, optimizer, lr_lambda, microbatches, clip=None):
    """Losses, gradient norms and learning rates per step of eager training with the schedule."""
    opt = eager_optimizer(model, optimizer)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)
    norms: list[float] = []
    losses = eager_train(model, batches, loss_fn=lm_loss, optimizer=lambda _: opt, microbatches=microbatches,
                         clip_grad_norm=clip, after_step=sched.step, norms=norms)
    return losses, norms, opt


def pipeline_run(pipe, batches, sched):
    losses, norms = [], []
    for (ids,), target in batches:
        losses.append(pipe.step(ids, target=target))
        norms.append(pipe.last_grad_norm)
        sched.step()
    return losses, norms


def compiled(model, batches, devices, optimizer, microbatches=4, **kwargs):
    (ids,), target = batches[0]
    return sw.compile(model, devices, (ids,), loss_fn=lm_loss, example_target=target, optimizer=optimizer,
                      microbatches=microbatches, cost="analytic", **kwargs)


@pytest.mark.parametrize(
    ("devices", "optimizer", "lr_lambda", "kwargs"),
    [
        (2, adamw, warmup_cosine, {"schedule": "1f1b", "swap": "off"}),
        (4, GROUPED, warmup_cosine, {"schedule": "gpipe", "swap": "off", "clip_grad_norm": 0.5}),
        (2, GROUPED, halving, {"schedule": "1f1b", "swap": "on", "clip_grad_norm": 0.5}),
        (2, adamw, halving, {"schedule": "harmony-pp", "swap": "on", "optimizer_on_host": True}),
    ],
)
def test_a_scheduler_on_pipe_optimizer_trains_like_eager(devices, optimizer, lr_lambda, kwargs):
    torch.manual_seed(0)
    model, batches = TinyGPT(layers=4), token_batches(steps=4)
    reference = copy.deepcopy(model)
    pipe = compiled(model, batches, devices, optimizer, **kwargs)
    sched = torch.optim.lr_scheduler.LambdaLR(pipe.optimizer, lr_lambda)
    got, got_norms = pipeline_run(pipe, batches, sched)
    want, want_norms, opt = eager_run(reference, batches, optimizer, lr_lambda, 4, kwargs.get("clip_grad_norm"))
    torch.testing.assert_close(torch.stack(got), torch.stack(want), rtol=RTOL, atol=ATOL)
    assert_state_equal(pipe.state_dict(), reference.state_dict())
    assert [g["lr"] for g in pipe.optimizer.param_groups] == [g["lr"] for g in opt.param_groups]
    if "clip_grad_norm" in kwargs:
        torch.testing.assert_close(torch.tensor(got_norms), torch.tensor(want_norms), rtol=1e-5, atol=1e-6)
    else:
        assert got_norms == [None] * len(batches)


def test_groups_by_name_and_the_state_dict_carry_the_models_names():
    torch.manual_seed(0)
    model, batches = TinyGPT(layers=4), token_batches(steps=2)
    reference = copy.deepcopy(model)
    optimizer = sw.ParamGroups(torch.optim.AdamW, by_names_groups, lr=LR, weight_decay=0.1, eps=1e-4)
    pipe = compiled(model, batches, 2, optimizer, schedule="1f1b", swap="off")
    sched = torch.optim.lr_scheduler.LambdaLR(pipe.optimizer, halving)
    got, _ = pipeline_run(pipe, batches, sched)
    named = list(reference.named_parameters())
    opt = torch.optim.AdamW([{**g, "params": [dict(named)[n] for n in g["params"]]} for g in by_names_groups(named)],
                            lr=LR, weight_decay=0.1, eps=1e-4)
    eager_sched = torch.optim.lr_scheduler.LambdaLR(opt, halving)
    eager_train(reference, batches, loss_fn=lm_loss, optimizer=lambda _: opt, microbatches=4,
                after_step=eager_sched.step)
    assert_state_equal(pipe.state_dict(), reference.state_dict())
    state = pipe.optimizer.state_dict()
    want_names = [[n for n, _ in named if "blocks" in n], [n for n, _ in named if "blocks" not in n]]
    assert [g["param_names"] for g in state["param_groups"]] == want_names  # the model's names, in its order
    assert [g["lr"] for g in state["param_groups"]] == [g["lr"] for g in opt.param_groups]
    assert set(state["state"]) == {n for n, _ in named}  # the tied embedding under its first name, tok.weight
    eager_state = {n: opt.state[p] for n, p in named}
    for name, values in state["state"].items():
        for key in ("exp_avg", "exp_avg_sq", "step"):
            torch.testing.assert_close(values[key], eager_state[name][key], rtol=RTOL, atol=ATOL)


def test_optimizer_state_dict_loads_into_a_fresh_pipeline_and_trains_on_identically():
    torch.manual_seed(0)
    model, batches = TinyGPT(layers=4), token_batches(steps=4)
    twin = copy.deepcopy(model)
    pipe = compiled(model, batches, 2, GROUPED, schedule="1f1b", swap="on")
    sched = torch.optim.lr_scheduler.LambdaLR(pipe.optimizer, warmup_cosine)
    pipeline_run(pipe, batches[:2], sched)
    other = compiled(twin, batches, 2, GROUPED, schedule="gpipe", swap="off")
    other_sched = torch.optim.lr_scheduler.LambdaLR(other.optimizer, warmup_cosine)
    other.load_state_dict(pipe.state_dict())
    other.optimizer.load_state_dict(pipe.optimizer.state_dict())
    other_sched.load_state_dict(sched.state_dict())
    got, _ = pipeline_run(other, batches[2:], other_sched)
    want, _ = pipeline_run(pipe, batches[2:], sched)
    torch.testing.assert_close(torch.stack(got), torch.stack(want), rtol=RTOL, atol=ATOL)
    assert_state_equal(other.state_dict(), pipe.state_dict())


def test_save_and_load_keep_the_learning_rates_and_resume_bitwise(tmp_path):
    torch.manual_seed(0)
    model, batches = TinyGPT(layers=4), token_batches(steps=5)
    pipe = compiled(model, batches, 2, GROUPED, schedule="1f1b", swap="on", clip_grad_norm=0.5)
    sched = torch.optim.lr_scheduler.LambdaLR(pipe.optimizer, warmup_cosine)
    pipeline_run(pipe, batches[:2], sched)
    pipe.save(tmp_path / "ckpt", scheduler=sched, extra={"epoch": 3, "note": "mid-run"})
    want, want_norms = pipeline_run(pipe, batches[2:], sched)

    loaded = sw.load(tmp_path / "ckpt")
    assert loaded.extra == {"epoch": 3, "note": "mid-run"}
    resumed = torch.optim.lr_scheduler.LambdaLR(loaded.optimizer, warmup_cosine)  # overwrites the lrs, as in torch
    loaded.load_scheduler(resumed)
    assert resumed.last_epoch == 2
    assert [g["lr"] for g in loaded.optimizer.param_groups] == [LR * warmup_cosine(2)] * 2
    got, got_norms = pipeline_run(loaded, batches[2:], resumed)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert got_norms == want_norms  # each stage sums its squares in name order, also after a load
    for name, tensor in pipe.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name


def test_bad_optimizer_groups_and_misuse_are_named():
    model, batches = TinyGPT(layers=2), token_batches(steps=1)
    with pytest.raises(sw.OptionError, match="in no group"):
        compiled(model, batches, 2, sw.ParamGroups(torch.optim.AdamW, partial_groups, lr=LR))
    with pytest.raises(sw.OptionError, match="in groups 0 and 1"):
        compiled(model, batches, 2, sw.ParamGroups(torch.optim.AdamW, overlapping_groups, lr=LR))
    with pytest.raises(sw.OptionError, match="not a trainable parameter"):
        compiled(model, batches, 2, sw.ParamGroups(torch.optim.AdamW, unknown_groups, lr=LR))
    with pytest.raises(sw.OptionError, match="Optimizer class"):
        compiled(model, batches, 2, sw.ParamGroups(adamw, no_decay_groups, lr=LR))
    pipe = compiled(model, batches, 2, GROUPED, schedule="1f1b")
    with pytest.raises(sw.OptionError, match="pipe.step"):
        pipe.optimizer.step()
    state = pipe.optimizer.state_dict()
    state["param_groups"] = state["param_groups"][::-1]
    with pytest.raises(sw.StateDictError, match="same optimizer groups"):
        pipe.optimizer.load_state_dict(state)
    with pytest.raises(sw.CheckpointError, match="no saved scheduler state"):
        pipe.load_scheduler(torch.optim.lr_scheduler.LambdaLR(pipe.optimizer, halving))
