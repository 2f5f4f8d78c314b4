"""The training API under two gloo ranks: evaluate / predict in eval mode, pipe.optimizer with a
scheduler and parameter groups by name, the gradient norm, the optimizer's state_dict by name, the
token-mean loss over padded labels, and resuming from a checkpoint bitwise; each against eager
PyTorch (or, where dropout draws keyed masks eager cannot draw, against the same pipeline run
without the interruption).

As in tests/test_distributed.py one pair of spawned ranks runs the whole matrix of cases, one
after another, each saving what the parent then checks as its own test. Every rank computes the
same thing (losses, gathered state): the parent checks both.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import stagewise as sw
from stagewise.compiler.assembly.state_dict import model_name
from tests.harness.ranks import case_results, run_cases, spawn
from tests.reference import ADAMW, ATOL, RTOL, SGD, assert_state_equal, chunks, eager_train, model_loss
from tests.training_problems import (
    GROUPED,
    LOSS_FNS,
    LR,
    MICROBATCHES,
    TIMEOUT_S,
    batches_of,
    compiled,
    evaluate,
    model_of,
    state_of,
    step,
    train_scheduled,
    warmup_cosine,
)

LIMIT_S = 150.0  # the whole matrix on one pair of ranks
# ---- what the ranks run, per kind of case -------------------------------------------------------
EVALUATE_AFTER = 2  # training steps before the evaluation, then one more


def run_evaluate(name: str, schedule: str) -> dict:
    """Train, evaluate (and predict where the output is known), train on; a twin pipeline trains the
    same steps without evaluating: dropout's keyed masks and BatchNorm's statistics make the two
    equal only if evaluating moved nothing."""
    dropout = 0.0 if name == "resnet" else 0.1
    batches = batches_of(name, EVALUATE_AFTER + 1)
    pipe = compiled(name, batches, schedule, dropout=dropout)
    losses = [step(pipe, b) for b in batches[:EVALUATE_AFTER]]
    trained = state_of(pipe)
    result = {"trained": trained, "eval": evaluate(pipe, batches[-1]), "eval_again": evaluate(pipe, batches[-1])}
    inputs = batches[-1][0]  # a model returning its own loss predicts its .logits (labels given, unused)
    result["predict"] = pipe.predict(*inputs) if name in LOSS_FNS else pipe.predict(**inputs).logits
    result["iteration"] = pipe._executor.state.iteration
    result["training"] = pipe.training
    losses.append(step(pipe, batches[-1]))
    twin = compiled(name, batches, schedule, dropout=dropout)
    result.update(losses=losses, state=state_of(pipe), twin_losses=[step(twin, b) for b in batches],
                  twin_state=state_of(twin))
    return result


OPTIMIZER_STEPS = 3


def run_optimizer(name: str, schedule: str) -> dict:
    """ParamGroups by name, a LambdaLR on pipe.optimizer, clipping; the optimizer's state_dict by name,
    gathered on every rank, and loaded back."""
    batches = batches_of(name, OPTIMIZER_STEPS)
    pipe = compiled(name, batches, schedule, optimizer=GROUPED, clip_grad_norm=0.5)
    sched = torch.optim.lr_scheduler.LambdaLR(pipe.optimizer, warmup_cosine)
    losses, norms, used_lrs = [], [], []
    for batch in batches:
        losses.append(step(pipe, batch))
        norms.append(pipe.last_grad_norm)
        used_lrs.append(([g["lr"] for g in pipe.optimizer.param_groups],  # what the step used, in every stage
                         sorted({(i, g["lr"]) for w in pipe._workers for i, g in enumerate(w.optimizer.param_groups)})))
        sched.step()
    stage_decay = sorted({(model_name(pipe.plan, n), g["weight_decay"]) for w in pipe._workers
                          for g in w.optimizer.param_groups for n, p in w.params.items()
                          if any(p is q for q in g["params"])})
    optimizer_state = pipe.optimizer.state_dict()
    pipe.optimizer.load_state_dict(optimizer_state)
    return {"losses": losses, "norms": norms, "state": state_of(pipe), "optimizer": optimizer_state,
            "reloaded": pipe.optimizer.state_dict(), "lrs": [g["lr"] for g in pipe.optimizer.param_groups],
            "used_lrs": used_lrs, "stage_decay": stage_decay}


def run_token_mean(name: str, schedule: str) -> dict:
    """Padded labels, a different number of counted tokens per microbatch, TokenMean declared."""
    batches = batches_of(name, 2, padded=True)
    pipe = compiled(name, batches, schedule, optimizer=SGD,
                    loss_reduction=sw.TokenMean(ignore_index=-100, labels="labels", shift=True))
    losses = [step(pipe, b) for b in batches]
    return {"losses": losses, "state": state_of(pipe), "weights": pipe._executor.state.loss_weights.weights,
            "eval": evaluate(pipe, batches[0])}


SAVED_AFTER, RESUMED_FOR = 2, 2


def run_resume(name: str, schedule: str, directory: Path) -> dict:
    """Train, save with the scheduler and metadata, train on; load, re-attach a fresh scheduler and
    train on from the checkpoint, the global torch RNG moved on differently on each rank (so the
    resumed run cannot be depending on it): both continuations must be bitwise equal."""
    batches = batches_of(name, SAVED_AFTER + RESUMED_FOR)
    pipe = compiled(name, batches, schedule, optimizer=GROUPED, clip_grad_norm=0.5, dropout=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(pipe.optimizer, warmup_cosine)
    saved = train_scheduled(pipe, sched, batches[:SAVED_AFTER])
    pipe.save(directory, scheduler=sched, extra={"epoch": 3})
    original = train_scheduled(pipe, sched, batches[SAVED_AFTER:])
    loaded = sw.load(directory)
    loaded.timeout_s = TIMEOUT_S
    torch.manual_seed(1000 + dist.get_rank())
    torch.rand(17)
    resumed = torch.optim.lr_scheduler.LambdaLR(loaded.optimizer, warmup_cosine)
    loaded.load_scheduler(resumed)
    return {"saved": saved, "original": original, "resumed": train_scheduled(loaded, resumed, batches[SAVED_AFTER:]),
            "state": state_of(pipe), "resumed_state": state_of(loaded), "extra": loaded.extra,
            "optimizer": pipe.optimizer.state_dict(), "resumed_optimizer": loaded.optimizer.state_dict()}


def run_morph(name: str, schedule: str, out: Path) -> dict:
    """Restore the checkpoint a 4-device run in one process saved (the parent's `four_devices`) into
    this 2-rank pipeline with its scheduler, save it again from the 2 ranks, and train on; and
    `sw.load` it onto the 2 ranks without the model (its graph planned again), and train on."""
    batches = batches_of(name, SAVED_AFTER + RESUMED_FOR)
    pipe = compiled(name, batches, schedule, optimizer=GROUPED, clip_grad_norm=0.5, dropout=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(pipe.optimizer, warmup_cosine)
    move = pipe.restore(out / "four-devices", report=False)
    pipe.load_scheduler(sched)
    pipe.save(out / "two-ranks", scheduler=sched)
    result = {"resumed": train_scheduled(pipe, sched, batches[SAVED_AFTER:]), "state": state_of(pipe),
              "read": move.read_bytes, "moved": move.moved_bytes}
    replanned = sw.load(out / "four-devices", devices=dist.get_world_size(), report=False)
    replanned.timeout_s = TIMEOUT_S
    sched = torch.optim.lr_scheduler.LambdaLR(replanned.optimizer, warmup_cosine)
    replanned.load_scheduler(sched)
    result["replanned"] = {"resumed": train_scheduled(replanned, sched, batches[SAVED_AFTER:]),
                           "state": state_of(replanned), "devices": len(replanned.plan.devices)}
    return result


RUNNERS: dict[str, Callable[..., dict]] = {"evaluate": run_evaluate, "optimizer": run_optimizer,
                                           "token-mean": run_token_mean}
CASES = (
    ("evaluate", "resnet", "1f1b"),
    ("evaluate", "tied-gpt", "1f1b"),
    ("evaluate", "hf-gpt2", "varuna"),
    ("evaluate", "hf-llama", "gpipe"),
    ("optimizer", "tied-gpt", "gpipe"),
    ("optimizer", "hf-gpt2", "interleaved"),
    ("optimizer", "hf-llama", "1f1b"),
    ("token-mean", "hf-gpt2", "1f1b"),
    ("token-mean", "hf-llama", "interleaved"),
    ("resume", "tied-gpt", "1f1b"),
    ("resume", "hf-gpt2", "interleaved"),
    ("resume", "hf-llama", "gpipe"),
    ("morph", "hf-gpt2", "1f1b"),
)


def _run_cases(rank: int, init_file: str, out: str, cases) -> None:
    run_cases(rank, init_file, out, cases, functools.partial(_run_case, Path(out)))


def _run_case(out: Path, case) -> dict:
    kind, name, schedule = case
    if kind == "resume":
        return run_resume(name, schedule, out / "-".join(case))
    if kind == "morph":
        return run_morph(name, schedule, out)
    return RUNNERS[kind](name, schedule)


# ---- the parent ------------------------------------------------------------------------------
def _morph_run(devices: int, checkpoint: Path | None, out: Path | None = None) -> dict:
    """GPT-2 with dropout, groups, warmup-cosine and clipping in one process on `devices`: trained
    for SAVED_AFTER steps and saved to `out` (or restored from `checkpoint`), then trained on."""
    batches = batches_of("hf-gpt2", SAVED_AFTER + RESUMED_FOR)
    pipe = compiled("hf-gpt2", batches, "1f1b", optimizer=GROUPED, clip_grad_norm=0.5, dropout=0.1, devices=devices)
    sched = torch.optim.lr_scheduler.LambdaLR(pipe.optimizer, warmup_cosine)
    if checkpoint is None:
        train_scheduled(pipe, sched, batches[:SAVED_AFTER])
        pipe.save(out, scheduler=sched)
    else:
        pipe.restore(checkpoint, report=False)
        pipe.load_scheduler(sched)
    return {"resumed": train_scheduled(pipe, sched, batches[SAVED_AFTER:]), "state": state_of(pipe)}


@pytest.fixture(scope="module")
def four_devices(tmp_path_factory) -> tuple[Path, dict]:
    """The run the morph case goes on from: saved on 4 devices in one process, then uninterrupted."""
    out = tmp_path_factory.mktemp("training-api")
    return out, _morph_run(4, None, out / "four-devices")


@pytest.fixture(scope="module")
def ranks(four_devices) -> list[dict]:
    results = spawn(_run_cases, four_devices[0], CASES, limit_s=LIMIT_S, fail_on_hang=False)
    return [result or {} for result in results]


def _results(ranks: list[dict], case) -> list[dict]:
    """Both ranks' results of `case`, each rank's own failure shown."""
    return case_results(ranks, case, LIMIT_S)


def _exact(got, want) -> None:
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True)), (got, want)


def _close(got, want) -> None:
    torch.testing.assert_close(torch.stack(list(got)), torch.stack(list(want)), rtol=RTOL, atol=ATOL)


def _eager_eval(name: str, state: dict, batch) -> tuple[torch.Tensor, torch.Tensor]:
    """Eager `model.eval()` under no_grad with `state`: the mean of the microbatches' losses, and
    the outputs of the whole batch."""
    model = model_of(name, 0.1)
    model.load_state_dict(state)
    model.eval()
    inputs, target = batch
    with torch.no_grad():
        losses = [model_loss(model, x, t, LOSS_FNS.get(name)) for x, t in chunks(inputs, target, MICROBATCHES)]
        outputs = model(*inputs) if name in LOSS_FNS else model(**inputs).logits
    return torch.stack(losses).mean(), outputs


@pytest.mark.parametrize("case", [c for c in CASES if c[0] == "evaluate"], ids="-".join)
def test_evaluate_and_predict_equal_eager_eval_and_move_nothing(ranks, case):
    _, name, _ = case
    results = _results(ranks, case)
    batch = batches_of(name, EVALUATE_AFTER + 1)[-1]
    want_loss, want_outputs = _eager_eval(name, results[0]["trained"], batch)
    for result in results:
        assert_state_equal(result["trained"], results[0]["trained"])
        torch.testing.assert_close(result["eval"], want_loss, rtol=RTOL, atol=ATOL)
        assert torch.equal(result["eval_again"], result["eval"])  # eval mode draws nothing
        torch.testing.assert_close(result["predict"], want_outputs, rtol=RTOL, atol=ATOL)
        assert result["iteration"] == EVALUATE_AFTER and result["training"]
        _exact(result["losses"], result["twin_losses"])  # as if evaluate had not run: masks, statistics
        for key, tensor in result["twin_state"].items():
            assert torch.equal(result["state"][key], tensor), key


def test_evaluate_then_training_equals_eager_training_with_batchnorm(ranks):
    """No dropout: the whole run, evaluate in the middle, equals eager training (BatchNorm's running
    statistics untouched by the evaluation)."""
    case = ("evaluate", "resnet", "1f1b")
    results = _results(ranks, case)
    model, batches = model_of("resnet", 0.0), batches_of("resnet", EVALUATE_AFTER + 1)
    want = eager_train(model, batches, loss_fn=F.cross_entropy, optimizer=ADAMW, microbatches=MICROBATCHES)
    for result in results:
        _close(result["losses"], want)
        assert_state_equal(result["state"], model.state_dict())


def _eager_scheduled(name: str) -> tuple[list, list[float], torch.optim.Optimizer, torch.nn.Module]:
    model, batches = model_of(name, 0.0), batches_of(name, OPTIMIZER_STEPS)
    opt = torch.optim.AdamW(GROUPED.resolve(list(model.named_parameters())), **GROUPED.defaults)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine)
    norms: list[float] = []
    losses = eager_train(model, batches, loss_fn=LOSS_FNS.get(name), optimizer=lambda _: opt, microbatches=MICROBATCHES,
                         clip_grad_norm=0.5, after_step=sched.step, norms=norms)
    return losses, norms, opt, model


@pytest.mark.parametrize("case", [c for c in CASES if c[0] == "optimizer"], ids="-".join)
def test_scheduler_groups_and_grad_norm_reach_every_stage_on_every_rank(ranks, case):
    _, name, _ = case
    results = _results(ranks, case)
    want, want_norms, opt, model = _eager_scheduled(name)
    named = dict(model.named_parameters())
    want_decay = sorted((n, g["weight_decay"]) for g in opt.param_groups for n in _names(g, named))
    for rank, result in enumerate(results):
        _close(result["losses"], want)
        assert_state_equal(result["state"], model.state_dict())
        torch.testing.assert_close(torch.tensor(result["norms"]), torch.tensor(want_norms), rtol=RTOL, atol=ATOL)
        assert result["lrs"] == [g["lr"] for g in opt.param_groups]
        for step_index, (lrs, stage_lrs) in enumerate(result["used_lrs"]):
            assert lrs == [LR * warmup_cosine(step_index)] * 2
            assert stage_lrs == sorted(enumerate(lrs)), rank  # every stage of this rank
        decay = set(want_decay)
        assert result["stage_decay"] and set(result["stage_decay"]) <= decay, rank
    assert sorted({d for r in results for d in r["stage_decay"]}) == want_decay  # every parameter, some rank
    _check_optimizer_state(results, opt, named)


def _names(group: dict, named: dict) -> list[str]:
    return [next(n for n, q in named.items() if q is p) for p in group["params"]]


def _check_optimizer_state(results: list[dict], opt: torch.optim.Optimizer, named: dict) -> None:
    """pipe.optimizer.state_dict() on every rank: the whole model's state by name, equal to eager's."""
    names = {id(p): n for n, p in named.items()}
    want_groups = [[names[id(p)] for p in g["params"]] for g in opt.param_groups]
    for result in results:
        state = result["optimizer"]
        assert [g["param_names"] for g in state["param_groups"]] == want_groups
        assert [g["lr"] for g in state["param_groups"]] == [g["lr"] for g in opt.param_groups]
        assert set(state["state"]) == set(named)
        for name, param in named.items():
            for key in ("exp_avg", "exp_avg_sq", "step"):
                torch.testing.assert_close(state["state"][name][key], opt.state[param][key], rtol=RTOL, atol=ATOL)
        assert repr(result["reloaded"]) == repr(state)  # load_state_dict puts back what it was given


@pytest.mark.parametrize("case", [c for c in CASES if c[0] == "token-mean"], ids="-".join)
def test_token_mean_over_padded_labels_equals_eager_on_the_whole_batch(ranks, case):
    _, name, _ = case
    results = _results(ranks, case)
    model, batches = model_of(name, 0.0), batches_of(name, 2, padded=True)
    opt = SGD(model.parameters())
    want = []
    for inputs, _ in batches:
        opt.zero_grad()
        loss = model(**inputs).loss  # the mean over every counted token of the batch
        loss.backward()
        opt.step()
        want.append(loss.detach())
    labels = batches[-1][0]["labels"][:, 1:]
    counts = [int((part != -100).sum()) for part in labels.chunk(MICROBATCHES)]
    assert len(set(counts)) > 1  # the microbatches count different numbers of tokens
    with torch.no_grad():
        want_eval = model.eval()(**batches[0][0]).loss
    for result in results:
        _close(result["losses"], want)
        assert_state_equal(result["state"], model.state_dict())
        assert result["weights"] == tuple(c / sum(counts) for c in counts)
        torch.testing.assert_close(result["eval"], want_eval, rtol=RTOL, atol=ATOL)  # evaluate weighs alike


@pytest.mark.parametrize("case", [c for c in CASES if c[0] == "resume"], ids="-".join)
def test_resumed_run_is_bitwise_the_uninterrupted_one(ranks, case):
    """Dropout on, AdamW with no-decay groups, warmup and cosine, clipping: the run resumed from the
    checkpoint (a fresh scheduler, the global RNG elsewhere) equals the uninterrupted one bitwise."""
    results = _results(ranks, case)
    for result in results:
        assert result["extra"] == {"epoch": 3}
        got, want = result["resumed"], result["original"]
        _exact([loss for loss, _, _ in got], [loss for loss, _, _ in want])
        assert [(norm, lrs) for _, norm, lrs in got] == [(norm, lrs) for _, norm, lrs in want]
        assert [lrs for _, _, lrs in want] == [[LR * warmup_cosine(s)] * 2 for s in range(SAVED_AFTER, SAVED_AFTER + RESUMED_FOR)]
        for key, tensor in result["state"].items():
            assert torch.equal(result["resumed_state"][key], tensor), key
        assert repr(result["resumed_optimizer"]) == repr(result["optimizer"])
    _exact([loss for loss, _, _ in results[1]["original"]], [loss for loss, _, _ in results[0]["original"]])
    losses = [loss for loss, _, _ in results[0]["saved"] + results[0]["original"]]
    assert len(set(float(x) for x in losses)) == len(losses)  # it trained: dropout and the schedule moved it


def test_training_with_dropout_under_two_ranks_equals_one_process(ranks):
    """The keyed streams do not depend on the process count: the uninterrupted distributed run with
    dropout equals the same training in one process on one device."""
    case = ("resume", "tied-gpt", "1f1b")
    results = _results(ranks, case)
    batches = batches_of("tied-gpt", SAVED_AFTER + RESUMED_FOR)
    pipe = compiled("tied-gpt", batches, "gpipe", optimizer=GROUPED, clip_grad_norm=0.5, dropout=0.1, devices=1)
    sched = torch.optim.lr_scheduler.LambdaLR(pipe.optimizer, warmup_cosine)
    want = [loss for loss, _, _ in train_scheduled(pipe, sched, batches)]
    _close([loss for loss, _, _ in results[0]["saved"] + results[0]["original"]], want)
    assert_state_equal(results[0]["state"], pipe.state_dict())


def _close_runs(got: dict, want: dict) -> None:
    """Two continuations of one checkpoint on other splits: equal within fp32 tolerance."""
    _close([loss for loss, _, _ in got["resumed"]], [loss for loss, _, _ in want["resumed"]])
    assert [lrs for _, _, lrs in got["resumed"]] == [lrs for _, _, lrs in want["resumed"]]
    for key, tensor in want["state"].items():
        torch.testing.assert_close(got["state"][key], tensor, rtol=1e-4, atol=1e-6, msg=key)


def test_a_run_saved_on_four_devices_goes_on_under_two_ranks(ranks, four_devices):
    """Varuna's morphing: 4 devices in one process -> 2 gloo ranks, each reading only its stages' names."""
    results = _results(ranks, ("morph", "hf-gpt2", "1f1b"))
    for rank, result in enumerate(results):
        _close_runs(result, four_devices[1])
        assert result["read"][rank] > 0 and result["moved"][rank] <= result["read"][rank]
        assert result["replanned"]["devices"] == 2
        _close_runs(result["replanned"], four_devices[1])


@pytest.mark.parametrize("devices", [1, 3])
def test_a_checkpoint_saved_under_two_ranks_goes_on_in_one_process(ranks, four_devices, devices):
    _results(ranks, ("morph", "hf-gpt2", "1f1b"))
    _close_runs(_morph_run(devices, four_devices[0] / "two-ranks"), four_devices[1])
