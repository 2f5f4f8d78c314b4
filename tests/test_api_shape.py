"""The public API's shape: `Pipeline` exposes only what users are told to use, and compile's and
plan's options come in three checked groups (sw.PlanOptions, sw.MemoryOptions, sw.TrainingOptions)
that mean exactly what the flat keywords mean."""

import pytest
import torch
import torch.nn.functional as F

import stagewise as sw
from tests.models.mlp import mlp

X, Y = torch.randn(8, 8), torch.randint(0, 5, (8,))
GPU = sw.Device("cuda", memory="80GiB", peak_flops="989TFLOPS")

# What the guides and the README tell users to use. A new public name on Pipeline is API: add it
# here (and document it) on purpose, or give it a leading underscore.
PIPELINE_API = {
    "step", "evaluate", "predict", "train", "eval", "training",
    "state_dict", "load_state_dict", "save", "wait_for_save", "restore", "resize",
    "optimizer", "load_scheduler", "extra",
    "plan", "programs", "stages", "shared", "stats", "time_breakdown", "simulate", "compile_times",
    "timeout_s", "loss_reduction", "loss_scale", "last_step_skipped", "skipped_steps", "last_grad_norm",
    "context",
}


@pytest.fixture(scope="module")
def pipe():
    """Compiled with every group, so that the test below can tell a group's value was applied."""
    return sw.compile(mlp(depth=3), 2, (X,), loss_fn=F.cross_entropy, example_target=Y,
                      plan=sw.PlanOptions(microbatches=2, schedule="gpipe", cost="analytic"),
                      memory=sw.MemoryOptions(swap="off"),
                      training=sw.TrainingOptions(clip_grad_norm=1.0, seed=7))


def test_a_pipeline_exposes_only_its_api(pipe):
    """dir() of an instance: the class's methods and properties and what __init__ sets."""
    assert {name for name in dir(pipe) if not name.startswith("_")} == PIPELINE_API


def test_compile_applies_each_group(pipe):
    assert (pipe.plan.microbatches, pipe.plan.schedule, pipe.plan.seed) == (2, sw.Schedule.GPIPE, 7)
    pipe.step(X, target=Y)
    assert pipe.last_grad_norm is not None  # clip_grad_norm reached the executor


def _plan(**options):
    return sw.plan(mlp(depth=4), [GPU, GPU], (X,), loss_fn=F.cross_entropy, example_target=Y, **options)


def test_plan_from_groups_is_the_plan_from_keywords():
    flat = _plan(microbatches=4, schedule="1f1b", swap="on", optimizer_on_host=True, precision="bf16")
    grouped = _plan(plan=sw.PlanOptions(microbatches=4, schedule=sw.Schedule.ONE_F_ONE_B),
                    memory=sw.MemoryOptions(swap="on", optimizer_on_host=True),
                    training=sw.TrainingOptions(precision="bf16", seed=0))
    assert grouped.to_json() == flat.to_json()


def test_groups_train_as_the_keywords_with_bf16_and_swapping():
    """The combination, not one option alone: bf16 stages with state swapped, clipping, a seed."""
    def trained(**options):
        torch.manual_seed(0)
        pipe = sw.compile(mlp(depth=3), 2, (X,), loss_fn=F.cross_entropy, example_target=Y, **options)
        losses = [pipe.step(X, target=Y) for _ in range(2)]
        return losses, pipe.state_dict()

    flat = trained(microbatches=2, schedule="1f1b", cost="analytic", swap="on", precision="bf16", clip_grad_norm=1.0,
                   seed=3)
    grouped = trained(plan=sw.PlanOptions(microbatches=2, schedule="1f1b", cost="analytic"),
                      memory=sw.MemoryOptions(swap="on"),
                      training=sw.TrainingOptions(precision="bf16", clip_grad_norm=1.0, seed=3))
    assert all(torch.equal(a, b) for a, b in zip(flat[0], grouped[0], strict=True))
    assert flat[1].keys() == grouped[1].keys()
    assert all(torch.equal(flat[1][k], grouped[1][k]) for k in flat[1])


@pytest.mark.parametrize(("group", "option"), [
    ("plan", {"microbatches": 2}), ("plan", {"schedule": "auto"}), ("memory", {"swap": "auto"}),
    ("training", {"precision": "fp32"}),
])
def test_an_option_given_both_ways_is_refused(group, option):
    """Even with equal values: the keyword and the group's field are two answers to one question."""
    groups = {"plan": sw.PlanOptions(), "memory": sw.MemoryOptions(), "training": sw.TrainingOptions()}
    (name,) = option
    with pytest.raises(sw.OptionError, match=f"{name}= is given both as a keyword of compile and in {group}="):
        sw.compile(mlp(), 2, (X,), loss_fn=F.cross_entropy, example_target=Y, **{group: groups[group]}, **option)


def test_a_group_of_the_wrong_class_is_refused():
    with pytest.raises(sw.OptionError, match=r"plan= is a MemoryOptions; give sw.PlanOptions"):
        _plan(plan=sw.MemoryOptions())
    with pytest.raises(sw.OptionError, match=r"training= is a dict"):
        sw.compile(mlp(), 2, (X,), loss_fn=F.cross_entropy, example_target=Y, training={"seed": 0})


@pytest.mark.parametrize(("make", "error", "message"), [
    (lambda: sw.PlanOptions(microbatches=0), sw.BatchSizeError, "microbatches must be a positive int"),
    (lambda: sw.PlanOptions(schedule="fastest"), sw.OptionError, "schedule"),
    (lambda: sw.PlanOptions(cost="guess"), sw.OptionError, "cost="),
    (lambda: sw.PlanOptions(split_points="blocks.2"), sw.OptionError, r"split_points=\['blocks.2'\]"),
    (lambda: sw.PlanOptions(replicas=0), sw.PlanError, "replicas must be"),
    (lambda: sw.PlanOptions(replicas=[2, 1], stages=2), sw.PlanError, "drop stages="),
    (lambda: sw.PlanOptions(virtual_devices=0), sw.OptionError, "virtual_devices=0"),
    (lambda: sw.MemoryOptions(swap="maybe"), sw.OptionError, "swap="),
    (lambda: sw.MemoryOptions(optimizer_on_host="no"), sw.OptionError, "optimizer_on_host='no' must be True"),
    (lambda: sw.TrainingOptions(clip_grad_norm=float("nan")), sw.OptionError, "clip_grad_norm=nan"),
    (lambda: sw.TrainingOptions(seed=-1), sw.OptionError, "seed=-1"),
    (lambda: sw.TrainingOptions(precision="fp8"), sw.PrecisionError, "precision='fp8'"),
])
def test_a_bad_field_fails_when_the_group_is_made(make, error, message):
    with pytest.raises(error, match=message):
        make()


def test_groups_read_names_as_members():
    options = sw.PlanOptions(schedule="1f1b", cost="analytic", split_points=["0"], replicas=[1, 1])
    assert (options.schedule, options.cost) == (sw.Schedule.ONE_F_ONE_B, sw.CostModel.ANALYTIC)
    assert options.split_points == ("0",) and options.replicas == (1, 1)  # frozen all the way down
    assert sw.MemoryOptions(swap="on").swap is sw.SwapMode.ON


@pytest.mark.parametrize(("options", "message"), [
    (sw.PlanOptions(cost="profile"), "cost='profile' times layers on this machine"),
    (sw.PlanOptions(virtual_devices=2), "virtual_devices= places a plan on this process's devices"),
])
def test_plan_refuses_what_only_compile_does(options, message):
    with pytest.raises(sw.OptionError, match=message):
        _plan(plan=options)
