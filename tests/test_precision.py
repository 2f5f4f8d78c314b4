"""Mixed precision (issue 11 item 4): bf16 and fp16 pipelines against eager torch.autocast training.

The eager reference accumulates over the same microbatches, each forward and loss under
torch.autocast, each backward outside it; fp16 through torch.amp.GradScaler. The pipeline runs
the same ops on the same dtypes, so what differs is only the order of fp32 sums: a tied
weight's gradient is summed across stages, and a loss across microbatches. An ulp of fp32 in a
weight can flip one bf16 rounding of an activation after the next step, which moves it by one
bf16 ulp (2**-8 relative), and a bf16 activation whose gradient comes back from several stages
(Llama's rotary cos / sin go to every stage) has its parts summed in bf16 in another order than
eager's autograd: one bf16 ulp of that gradient. Hence losses within 2e-3 relative (half a bf16
ulp of the loss) and parameters within 5e-4 (a bf16 ulp of gradients of order 1e-2, through
SGD's lr 0.05 and momentum over three steps). Measured: the tied GPT's losses equal to the bit
and parameters within 3e-8; Llama on 4 devices losses within 1e-5 relative, parameters 1.1e-4.
"""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch

import stagewise as sw
from tests.harness.measured import assert_peaks_agree, measured_cost, timing_variants
from tests.harness.precision import LOSS_RTOL, PARAM_ATOL, SGD, eager_autocast_train
from tests.hf import gpt2, llama, lm_batches
from tests.models.gpt import TinyGPT, lm_loss
from tests.reference import chunks


def gpt_batches(steps: int = 3):
    generator = torch.Generator().manual_seed(0)
    return [(((ids := torch.randint(0, 64, (8, 16), generator=generator)),), ids) for _ in range(steps)]


def run_pipeline(pipe, batches):
    losses = []
    for inputs, target in batches:
        kwargs = {"target": target} if pipe.plan.target_name else {}
        losses.append(float(pipe.step(**inputs, **kwargs) if isinstance(inputs, dict) else pipe.step(*inputs, **kwargs)))
    return losses


def assert_close_training(pipe, reference, pipe_losses, eager_losses) -> None:
    assert pipe_losses == pytest.approx(eager_losses, rel=LOSS_RTOL)
    state = pipe.state_dict()
    for name, expected in reference.state_dict().items():
        if expected.is_floating_point():
            assert state[name].dtype == torch.float32  # the masters stay fp32
            torch.testing.assert_close(state[name], expected, rtol=0, atol=PARAM_ATOL, msg=name)


CASES = [  # model, devices, schedule, split points, swap, precision
    ("gpt", 2, "1f1b", ["blocks.2"], "off", "bf16"),
    ("gpt", 4, "gpipe", ["blocks.0", "blocks.1", "blocks.3"], "on", "fp16"),
    ("gpt", 1, "gpipe", None, "off", "fp16"),
    ("gpt2", 2, "gpipe", ["transformer.h.2"], "off", "bf16"),
    ("llama", 4, "1f1b", ["model.layers.1", "model.layers.2", "model.layers.3"], "off", "bf16"),
    ("llama", 2, "1f1b", ["model.layers.2"], "off", "fp16"),
]


@pytest.mark.parametrize(("name", "devices", "schedule", "splits", "swap", "precision"), CASES)
def test_mixed_precision_trains_as_eager_autocast(name, devices, schedule, splits, swap, precision) -> None:
    torch.manual_seed(1)
    if name == "gpt":
        model, batches, loss_fn = TinyGPT(), gpt_batches(), lm_loss
    else:
        model, batches, loss_fn = (gpt2() if name == "gpt2" else llama()), lm_batches(steps=3), None
    reference = copy.deepcopy(model)
    inputs, target = batches[0]
    pipe = sw.compile(model, devices, inputs, loss_fn=loss_fn, example_target=target, optimizer=SGD, microbatches=2,
                      schedule=schedule, split_points=splits, swap=swap, cost="analytic", precision=precision)
    assert pipe.plan.precision == precision and f"precision: {precision}" in str(pipe.plan)
    losses = run_pipeline(pipe, batches)
    assert_close_training(pipe, reference, losses, eager_autocast_train(reference, batches, precision, 2, loss_fn))
    assert (pipe.loss_scale is None) == (precision == "bf16")
    assert not pipe.last_step_skipped


def compile_gpt(precision="fp16", devices=4, **options):
    torch.manual_seed(1)
    model = TinyGPT()
    (ids,), _ = gpt_batches(1)[0]
    splits = ["blocks.0", "blocks.1", "blocks.3"][:devices - 1]
    pipe = sw.compile(model, devices, (ids,), loss_fn=lm_loss, example_target=ids, optimizer=SGD, microbatches=2,
                      schedule="1f1b", split_points=splits, precision=precision, **{"cost": "analytic", **options})
    return pipe, model


def test_fp16_overflow_skips_the_step_on_every_stage_then_trains() -> None:
    pipe, _ = compile_gpt()
    batches = gpt_batches(3)
    run_pipeline(pipe, batches[:1])
    params = {k: v.clone() for k, v in pipe.state_dict().items()}
    optimizer = copy.deepcopy(pipe.optimizer.state_dict())
    pipe._executor.state.scaler.scale = 2.0**120  # the seed's scale overflows fp16 in every stage's backward
    run_pipeline(pipe, batches[1:2])
    assert pipe.last_step_skipped and pipe.loss_scale == 2.0**119
    assert not torch.isfinite(torch.tensor(pipe.last_grad_norm))
    for name, value in pipe.state_dict().items():
        assert torch.equal(value, params[name]), name  # no stage updated
    after = pipe.optimizer.state_dict()
    for key, state in optimizer["state"].items():
        assert all(torch.equal(after["state"][key][k], v) for k, v in state.items())
    assert all(w.params[n].grad is None for w in pipe._workers for n in w.params)
    pipe._executor.state.scaler.scale = 2.0**16
    run_pipeline(pipe, batches[2:])
    assert not pipe.last_step_skipped and pipe.loss_scale == 2.0**16
    assert any(not torch.equal(v, params[k]) for k, v in pipe.state_dict().items())


def test_fp16_clipping_equals_grad_scaler_unscale_then_clip() -> None:
    pipe, model = compile_gpt(clip_grad_norm=0.5, devices=2)
    reference = copy.deepcopy(model)  # compile leaves the model's weights as they were
    batches = gpt_batches(3)
    losses, norms = [], []
    for batch in batches:
        losses += run_pipeline(pipe, [batch])
        norms.append(pipe.last_grad_norm)
    eager_norms: list[float] = []
    eager = eager_autocast_train(reference, batches, "fp16", 2, lm_loss, clip=0.5, norms=eager_norms)
    assert norms == pytest.approx(eager_norms, rel=1e-5)
    assert_close_training(pipe, reference, losses, eager)


def test_fp16_scale_grows_and_resumes_bitwise(tmp_path) -> None:
    scaling = sw.LossScaling(init=2.0**10, growth_interval=2)
    batches = gpt_batches(4)
    whole, _ = compile_gpt(scaling, devices=2)
    uninterrupted = run_pipeline(whole, batches[:3])
    whole.save(tmp_path / "ckpt")  # saving leaves the run as it was: it goes on as the uninterrupted one
    uninterrupted += run_pipeline(whole, batches[3:])
    assert whole.loss_scale == 2.0**12  # grew after steps 2 and 4
    resumed = sw.load(tmp_path / "ckpt")
    assert resumed.loss_scale == 2.0**11 and resumed._executor.state.scaler.clean_steps == 1
    assert run_pipeline(resumed, batches[3:]) == uninterrupted[3:]
    assert resumed.loss_scale == whole.loss_scale
    for name, value in resumed.state_dict().items():
        assert torch.equal(value, whole.state_dict()[name]), name


def test_a_rolled_back_step_leaves_the_loss_scale_as_it_was(monkeypatch) -> None:
    pipe, _ = compile_gpt(sw.LossScaling(growth_interval=1), devices=2)
    batches = gpt_batches(2)
    run_pipeline(pipe, batches[:1])
    scale = pipe.loss_scale

    def failing(*args, **kwargs):
        raise RuntimeError("injected update failure")

    monkeypatch.setattr(pipe._workers[1], "update", failing)
    with pytest.raises(RuntimeError, match="injected update failure"):
        run_pipeline(pipe, batches[1:])
    assert pipe.loss_scale == scale and pipe._executor.state.scaler.clean_steps == 0


def test_bf16_memory_is_planned_smaller_and_simulated_as_measured() -> None:
    """The planner's stash is the bf16 one (what the runtime holds), and pipe.stats' peak lies within
    the peaks pipe.simulate() gives on the measured sizes over the runtime's timings, as
    tests/test_differential.py checks for fp32."""
    stash = {}

    def run(precision: str):
        pipe, _ = compile_gpt(precision, devices=2)
        pipe._executor.state.opportunistic = False
        (ids,), _ = gpt_batches(1)[0]
        pipe.step(ids, target=ids)
        pipe.step(ids, target=ids)
        stash[precision] = [max(v for (grad, *_), v in w.stash_size.items() if grad) for w in pipe._workers]
        measured = replace(measured_cost(pipe), stash_bytes=tuple(float(b) for b in stash[precision]))
        return pipe.stats, timing_variants(pipe, measured)

    for precision in ("fp32", "bf16"):
        assert_peaks_agree(lambda precision=precision: run(precision))
    assert sum(stash["bf16"]) < sum(stash["fp32"]), stash


def test_profiled_and_analytic_stash_is_that_of_the_precision() -> None:
    """cost='profile' measures (and cost='analytic' fake-propagates) layers under the autocast."""
    for cost in ("profile", "analytic"):
        stash = {p: sum(c.stash_bytes for c in compile_gpt(p, devices=1, cost=cost)[0].plan.costs.layers)
                 for p in ("fp32", "bf16")}
        assert stash["bf16"] < 0.8 * stash["fp32"], cost


# ---- refusals ---------------------------------------------------------------------------------
def test_unknown_precision_and_bad_loss_scaling_are_refused() -> None:
    with pytest.raises(sw.PrecisionError, match="unknown precision='bfloat16'"):
        compile_gpt("bfloat16")
    with pytest.raises(sw.PrecisionError, match="backoff"):
        sw.LossScaling(backoff=2.0)


def test_low_precision_weights_are_refused() -> None:
    model = TinyGPT().to(torch.bfloat16)
    ids = torch.randint(0, 64, (8, 16))
    with pytest.raises(sw.PrecisionError, match="fp32 master weights.*precision='fp32'"):
        sw.compile(model, 1, (ids,), loss_fn=lm_loss, example_target=ids, precision="bf16")


def test_autocast_around_step_is_refused() -> None:
    pipe, _ = compile_gpt("fp32", devices=1)
    (ids,), _ = gpt_batches(1)[0]
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(sw.PrecisionError, match="precision='bf16'"):
        pipe.step(ids, target=ids)
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(sw.PrecisionError, match="evaluate"):
        pipe.evaluate(ids, target=ids)
    pipe.step(ids, target=ids)  # nothing was left half done


class AutocastInside(torch.nn.Module):
    """A model that runs part of its own forward under torch.autocast."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = torch.nn.Linear(8, 16), torch.nn.Linear(16, 16), torch.nn.Linear(16, 4)

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = self.b(self.a(x).relu()).relu()
        return self.c(h.float())


def test_autocast_inside_the_model_trains_as_eager() -> None:
    torch.manual_seed(0)
    model = AutocastInside()
    reference = copy.deepcopy(model)
    x, y = torch.randn(8, 8), torch.randint(0, 4, (8,))
    loss_fn = torch.nn.functional.cross_entropy
    pipe = sw.compile(model, 2, (x,), loss_fn=loss_fn, example_target=y, optimizer=SGD, microbatches=2,
                      schedule="gpipe", cost="analytic")
    losses = run_pipeline(pipe, [((x,), y)] * 2)
    opt = SGD(reference.parameters())
    eager = []
    for _ in range(2):
        opt.zero_grad()
        total = 0.0
        for (mb,), t in chunks((x,), y, 2):
            loss = loss_fn(reference(mb), t) / 2
            loss.backward()
            total += float(loss)
        opt.step()
        eager.append(total)
    assert_close_training(pipe, reference, losses, eager)


class CastBack(torch.nn.Module):
    """peft LoRA's shape: a trained adapter beside a frozen layer, their sum cast back with `.float()`,
    frozen layers after it. Branching on a size sends it through torch.export, whose fp32 trace
    records the cast as a dtype assertion that passes/precision_casts.py turns back into a cast."""

    def __init__(self):
        super().__init__()
        self.base = torch.nn.Linear(8, 8).requires_grad_(False)
        self.adapter = torch.nn.Linear(8, 8, bias=False)
        self.mid = torch.nn.Linear(8, 8).requires_grad_(False)
        self.top = torch.nn.Linear(8, 4).requires_grad_(False)

    def forward(self, x):
        h = (self.base(x) + self.adapter(x)).float()
        if x.shape[0] > 0:  # branching on a size: fx cannot trace it, torch.export can
            h = self.mid(h)
        return self.top(h)


def test_a_restored_cast_carries_the_gradient_across_a_cut() -> None:
    """The cast has the value it makes (fp32), so the cut analysis sees the adapter's gradient path
    through it: the stage after the cut sends the gradient back and the adapter moves (before, the
    cast had no value, the transfer none, and the adapter never trained)."""
    torch.manual_seed(0)
    model = CastBack()
    x, y = torch.randn(8, 8), torch.randn(8, 4)
    pipe = sw.compile(model, 2, (x,), loss_fn=torch.nn.functional.mse_loss, example_target=y, optimizer=SGD,
                      microbatches=2, schedule="1f1b", split_points=["top"], cost="analytic", precision="bf16")
    assert pipe.plan.tracer == "export"
    casts = [n for n in pipe.stages[0].graph.nodes if n.target is torch.ops.aten._to_copy.default]
    assert casts and all(n.meta["val"].dtype == torch.float32 for n in casts)
    assert [t.requires_grad for t in pipe.plan.transfers] == [True]
    before = model.adapter.weight.detach().clone()
    pipe.step(x, target=y)
    assert not torch.equal(pipe.state_dict()["adapter.weight"], before)
