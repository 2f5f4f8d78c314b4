"""compile() in named phases: each runs alone on the context the earlier ones filled, and running
them all gives the plan `sw.compile` gives."""

import pytest
import torch
import torch.nn.functional as F

import stagewise as sw
from stagewise.compiler.assembly.options import CompileOptions, CompileRequest
from stagewise.compiler.compile.context import CompileContext
from stagewise.compiler.compile.phases import (
    PHASES,
    analyse,
    capture,
    codegen,
    cost,
    plan,
    run_phases,
    runtime,
)
from stagewise.compiler.pipeline.pipeline import Pipeline
from tests.models.gpt import TinyGPT, lm_loss
from tests.models.mlp import mlp
from tests.reference import SGD

PLAN_OPTIONS = dict(optimizer=SGD, microbatches=2, schedule="1f1b", cost="analytic")


def _mlp_context(devices: int = 2, **options) -> tuple[CompileContext, dict]:
    x, y = torch.randn(8, 8), torch.randint(0, 5, (8,))
    kwargs = dict(loss_fn=F.cross_entropy, example_target=y, **PLAN_OPTIONS, **options)
    return CompileContext(CompileRequest.make(mlp(), devices, (x,), CompileOptions(**kwargs))), dict(x=x, y=y)


def test_each_phase_adds_its_result():
    ctx, batch = _mlp_context()
    assert ctx.request.batch == 8 and ctx.request.first_microbatches == 2 and len(ctx.request.devices) == 2

    capture(ctx)
    assert ctx.analysis is not None and ctx.analysis.tracer in ("fx", "export") and ctx.first is None

    analyse(ctx)
    assert ctx.first is not None and ctx.first.microbatch_size == 4
    assert len(ctx.first.layers) > 1 and len(ctx.first.cuts) == len(ctx.first.layers) - 1
    assert ctx.first.legal_cuts >= 1 and ctx.first.param_bytes == sum(
        p.numel() * p.element_size() for p in ctx.request.model.parameters())

    cost(ctx)
    assert ctx.costs is not None
    layer_costs = ctx.costs.layers.at(ctx.first.microbatch_size)
    assert len(layer_costs) == len(ctx.first.layers) and all(c.fwd_s > 0 for c in layer_costs)
    assert ctx.costs.state_ratio == 2 + ctx.costs.optimizer_ratio == 3  # SGD with momentum: one buffer

    plan(ctx)
    assert ctx.choice is not None and ctx.plan is not None
    assert ctx.plan.schedule == "1f1b" and ctx.plan.microbatches == 2 and len(ctx.plan.stages) == 2
    assert ctx.plan.considered == ()  # one plan asked for: nothing searched
    assert ctx.plan.predicted_iteration_s == ctx.choice.prediction.iteration_s > 0
    assert len(ctx.choice.sim_cost.forward_s) == 2

    codegen(ctx)
    assert ctx.modules is not None and len(ctx.modules) == 2
    assert all(isinstance(m, torch.fx.GraphModule) for m in ctx.modules)

    runtime(ctx)
    assert ctx.runtime is not None and len(ctx.runtime.workers) == 2 and len(ctx.runtime.pools) == 2
    loss = Pipeline(ctx.plan, ctx.runtime).step(batch["x"], target=batch["y"])
    assert torch.isfinite(loss)


def test_a_phase_run_too_early_says_which_phase_comes_first():
    ctx, _ = _mlp_context()
    with pytest.raises(sw.PlanError, match="capture phase"):
        analyse(ctx)
    capture(ctx)
    with pytest.raises(sw.PlanError, match="analyse phase"):
        cost(ctx)


def test_run_phases_times_every_phase_in_order():
    ctx, _ = _mlp_context()
    run_phases(ctx)
    assert list(ctx.seconds) == [phase.__name__ for phase in PHASES] == [
        "capture", "analyse", "cost", "plan", "codegen", "runtime"]
    assert all(seconds >= 0 for seconds in ctx.seconds.values())


def _tied_gpt_batch():
    ids = torch.randint(0, 64, (8, 9))
    return ids[:, :-1], ids[:, 1:]


@pytest.mark.parametrize("searched", [False, True], ids=["asked", "searched"])
def test_the_phases_make_the_plan_compile_makes(searched):
    """On the tied GPT (shared embedding and head): the phases one by one and `sw.compile` agree on
    the plan, and the compiled pipeline carries the phases' times and the planner's costs."""
    x, y = _tied_gpt_batch()
    options = dict(loss_fn=lm_loss, example_target=y, optimizer=SGD, cost="analytic")
    options |= dict(schedule="auto", microbatches=None) if searched else dict(schedule="gpipe", microbatches=4)
    torch.manual_seed(0)
    ctx = CompileContext(CompileRequest.make(TinyGPT(), 2, (x,), CompileOptions(**options)))
    for phase in PHASES:
        phase(ctx)
    torch.manual_seed(0)
    pipe = sw.compile(TinyGPT(), 2, (x,), **options)
    assert ctx.plan is not None and ctx.plan.shared  # the tied weights span both stages
    assert pipe.plan == ctx.plan
    assert bool(pipe.plan.considered) == searched
    assert list(pipe.compile_times) == [phase.__name__ for phase in PHASES]
    assert pipe._sim_cost is not None and len(pipe._sim_cost.forward_s) == len(pipe.plan.stages)

