"""PipeDream-2BW (issue 25 item 3; Narayanan §3.2.1) as schedule="2bw": two weight versions per stage and
updates one step stale, W(t+1) = W(t) - lr * grad f(W(t-1)), checked against that rule written here in
plain PyTorch (not against eager, which it does not equal); its second version counted by the planner,
kept by checkpoints and by a failed step's rollback; opt-in only, refused where it cannot run."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.nn.functional as F

import stagewise as sw
from stagewise.compiler.checkpoint.dcp import NEWEST
from stagewise.compiler.checkpoint.read import read_checkpoint
from tests.harness.cli import stagewise_here
from tests.harness.two_bw import newest_state, two_bw_reference
from tests.models.gpt import TinyGPT, lm_loss
from tests.models.mlp import mlp
from tests.reference import ADAMW, ATOL, RTOL, SGD, assert_state_equal, eager_train, token_batches

STEPS, MICROBATCHES = 4, 2


def _mlp_batches():
    return [((torch.randn(8, 8),), torch.randint(0, 5, (8,))) for _ in range(STEPS)]


def _partly_frozen() -> torch.nn.Module:
    """The MLP with its first layer frozen (as a LoRA base is): one version, never moved."""
    model = mlp()
    for parameter in model[0].parameters():
        parameter.requires_grad_(False)
    return model


CASES = {"mlp-sgd-clipped": (mlp, _mlp_batches, SGD, F.cross_entropy, {"clip_grad_norm": 0.5}),
         "frozen-mlp-adamw": (_partly_frozen, _mlp_batches, ADAMW, F.cross_entropy, {}),
         "tied-gpt-adamw": (lambda: TinyGPT(layers=2), lambda: token_batches(STEPS), ADAMW, lm_loss, {}),
         "mlp-sgd-2x2": (mlp, _mlp_batches, SGD, F.cross_entropy, {"devices": 4, "replicas": 2})}


def _compiled(model, batches, optimizer, loss_fn, devices=2, **options):
    inputs, target = batches[0]
    options = {"schedule": "2bw", "asynchronous": True, **options}
    return sw.compile(model, devices, inputs, loss_fn=loss_fn, example_target=target, optimizer=optimizer,
                      microbatches=MICROBATCHES, cost="analytic", **options)


def _train(pipe, batches):
    return [pipe.step(*inputs, target=target) for inputs, target in batches]


@pytest.mark.parametrize("case", list(CASES))
def test_two_bw_trains_by_the_papers_update_rule(case):
    """Two stages (tied: the GPT's embedding and head; 2x2: two data-parallel copies of the pipeline)."""
    make, batches_of, optimizer, loss_fn, options = CASES[case]
    clip = options.get("clip_grad_norm")
    torch.manual_seed(0)
    model, batches = make(), batches_of()
    reference, synchronous = copy.deepcopy(model), copy.deepcopy(model)
    pipe = _compiled(model, batches, optimizer, loss_fn, **options)
    assert {s.position for s in pipe.plan.stages} == {0, 1} and pipe.plan.schedule == sw.Schedule.TWO_BW
    assert len(pipe.plan.stages) == 2 * options.get("replicas", 1)
    got = _train(pipe, batches)
    want, used, newest = two_bw_reference(reference, batches, optimizer, loss_fn, clip, microbatches=MICROBATCHES)
    torch.testing.assert_close(torch.stack(got), torch.stack(want), rtol=RTOL, atol=ATOL)
    assert_state_equal(pipe.state_dict(), used.state_dict())  # the version the next step computes with
    newest_got = newest_state(pipe)
    assert_state_equal(newest_got, {n: t for n, t in newest.state_dict().items() if n in newest_got})
    # the test can fail: from the third step on, 2BW's losses are not synchronous SGD's
    eager = eager_train(synchronous, batches, loss_fn=loss_fn, optimizer=optimizer, microbatches=MICROBATCHES,
                        clip_grad_norm=clip)
    assert not torch.allclose(torch.stack(got)[2:], torch.stack(eager)[2:], rtol=RTOL, atol=ATOL)


def _trained_bytes(pipe_plan, device: int) -> int:
    return sum(pipe_plan.layers[i].param_bytes for s in pipe_plan.stages if s.device == device for i in s.layers)


def test_the_planner_and_the_pools_count_two_weight_versions():
    """The predicted peak and host memory (the undo record) of each device grow by its trained weights
    over 1F1B's on the same split, its update by their copies, and the device pools hold both versions."""
    torch.manual_seed(0)
    model, batches = mlp(), _mlp_batches()
    (x,), y = batches[0]
    planned = {schedule: sw.plan(model, 2, (x,), loss_fn=F.cross_entropy, example_target=y, microbatches=2,
                                 split_points=["6"], schedule=schedule, asynchronous=schedule == "2bw")
               for schedule in ("1f1b", "2bw")}
    flush, two_bw = planned["1f1b"], planned["2bw"]
    assert two_bw.predicted_iteration_s > flush.predicted_iteration_s  # the update copies the versions
    for device in (0, 1):
        weights = _trained_bytes(two_bw, device)
        assert weights > 0
        assert two_bw.predicted_peak_bytes[device] - flush.predicted_peak_bytes[device] == weights
        assert two_bw.predicted_host_bytes[device] - flush.predicted_host_bytes[device] == weights
    pipe = _compiled(model, batches, SGD, F.cross_entropy, split_points=["6"])
    _train(pipe, batches[:1])
    assert [row["weights_bytes"] for row in pipe.stats] == [2 * _trained_bytes(pipe.plan, d) for d in (0, 1)]


def test_a_checkpoint_keeps_both_versions_and_load_resumes_bitwise(tmp_path):
    torch.manual_seed(1)
    model, batches = mlp(), _mlp_batches()
    pipe = _compiled(model, batches, SGD, F.cross_entropy)
    _train(pipe, batches[:2])
    pipe.save(tmp_path / "ck")
    want = _train(pipe, batches[2:])

    saved = read_checkpoint(tmp_path / "ck", None)
    trained = [n for n, p in model.named_parameters()]
    assert {f"{NEWEST}.{n}" for n in trained} <= set(saved.tensors)
    loaded = sw.load(tmp_path / "ck")
    assert loaded.plan.schedule == sw.Schedule.TWO_BW
    assert any(not torch.equal(loaded.state_dict()[n], newest_state(loaded)[n]) for n in trained)
    got = _train(loaded, batches[2:])
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True)), (got, want)
    for mine, theirs in ((loaded.state_dict(), pipe.state_dict()), (newest_state(loaded), newest_state(pipe))):
        assert all(torch.equal(tensor, theirs[name]) for name, tensor in mine.items())
    # planned again for one device from the saved graph: still 2bw, both versions read (no weight is shared)
    replanned = sw.load(tmp_path / "ck", devices=1, report=False)
    assert replanned.plan.schedule == sw.Schedule.TWO_BW and len(replanned.plan.stages) == 1
    assert all(torch.equal(g, w) for g, w in zip(_train(replanned, batches[2:]), want, strict=True))


class _Failing:
    """An optimizer factory whose optimizers raise in `step` while armed for them."""

    def __init__(self) -> None:
        self.made: list[torch.optim.Optimizer] = []
        self.armed: torch.optim.Optimizer | None = None

    def __call__(self, params):
        factory = self

        class Optimizer(torch.optim.SGD):
            def step(self, closure=None):  # noqa: ANN001, ANN202 - torch's signature
                if factory.armed is self:
                    raise RuntimeError("injected update failure")
                return super().step(closure)

        made = Optimizer(params, lr=0.05, momentum=0.9)
        self.made.append(made)
        return made


def test_a_failed_step_rolls_back_both_versions():
    """Stage 0 updates last in 1F1B's order: failing there, stage 1 has already written its newest
    version; the rollback puts it back, and training then follows the rule as if nothing failed."""
    torch.manual_seed(2)
    model, batches = mlp(), _mlp_batches()
    reference = copy.deepcopy(model)
    failing = _Failing()
    pipe = _compiled(model, batches, failing, F.cross_entropy)
    _train(pipe, batches[:2])
    before = ({n: t.clone() for n, t in pipe.state_dict().items()}, {n: t.clone() for n, t in newest_state(pipe).items()})
    failing.armed = pipe._workers[0].optimizer
    (x,), y = batches[2]
    with pytest.raises(RuntimeError, match="injected update failure"):
        pipe.step(x, target=y)
    assert all(torch.equal(t, before[0][n]) for n, t in pipe.state_dict().items())
    assert all(torch.equal(t, before[1][n]) for n, t in newest_state(pipe).items())
    failing.armed = None
    got = _train(pipe, batches[2:])
    want = two_bw_reference(reference, batches, functools.partial(torch.optim.SGD, lr=0.05, momentum=0.9),
                            F.cross_entropy, microbatches=MICROBATCHES)[0][2:]
    torch.testing.assert_close(torch.stack(got), torch.stack(want), rtol=RTOL, atol=ATOL)


REFUSED = {
    "2bw unasked": ({"schedule": "2bw"}, "Pass asynchronous=True"),
    "synchronous asked async": ({"schedule": "1f1b", "asynchronous": True}, "drop asynchronous=True"),
    "not a bool": ({"schedule": "2bw", "asynchronous": "yes"}, "must be True or False"),
    "swap": ({"schedule": "2bw", "asynchronous": True, "swap": "on"}, "swap='on' moves weights"),
    "host optimizer": ({"schedule": "2bw", "asynchronous": True, "optimizer_on_host": True}, "optimizer_on_host"),
    "tensor parallel": ({"schedule": "2bw", "asynchronous": True, "tensor_parallel": 2}, "tensor_parallel=2"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_refused_where_it_cannot_apply(case):
    options, message = REFUSED[case]
    (x,), y = _mlp_batches()[0]
    with pytest.raises(sw.OptionError, match=message):
        sw.compile(mlp(), 2, (x,), loss_fn=F.cross_entropy, example_target=y, microbatches=2, cost="analytic",
                   **options)


def test_auto_weighs_2bw_only_when_asynchronous_updates_are_allowed():
    gpu = sw.Device("cuda", memory="80GiB", peak_flops="100TFLOPS")
    (x,), y = _mlp_batches()[0]

    def considered(**options) -> str:
        chosen = sw.plan(mlp(), [gpu, gpu], (x,), loss_fn=F.cross_entropy, example_target=y, microbatches=2,
                         **options)
        return "\n".join(chosen.considered)

    assert "2bw" not in considered()
    assert "2bw" in considered(asynchronous=True)


def test_the_command_line_plans_2bw_labelled_asynchronous(capsys: pytest.CaptureFixture):
    status, out, err = stagewise_here(capsys, "plan", "tests.cli_factories:tiny_gpt", "--devices", "2xH100",
                                      "--schedule", "2bw", "--asynchronous", "--microbatches", "2", "--optimizer", "sgd")
    assert status == 0, err
    assert "2bw ASYNCHRONOUS: one-step-stale updates, two weight versions" in out
