"""Stages replicated each their own number of ways (PipeDream §2.4.1, e.g. a "2-1" plan on 3 devices):
the DP chooses them over the topology's levels, the plan expresses them as stage instances with
their own microbatches, lowering routes each microbatch between the instances that take it, and
the runtime trains such a plan exactly like eager training. The DP and the levels alone:
tests/test_pipedream_replication.py."""

from __future__ import annotations

import datetime
import itertools
import math
import os
import pickle
import random
import traceback
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import stagewise as sw
from stagewise.ir.instructions import AllReduceShared, Forward, Recv, Send, Stream, Update
from stagewise.ir.plan import DeviceSpec, LayerCost, SharedTensor, Stage, Transfer
from stagewise.ir.program import validate
from stagewise.ir.topology import Topology
from stagewise.passes.costs import stage_charges
from stagewise.passes.lower import lower
from stagewise.passes.pipedream_dp import (
    LayerCosts,
    StageSpan,
    plan_pipeline,
    plan_with_replicas,
)
from stagewise.passes.replicate import replicate_stages
from stagewise.passes.schedule import instance_tasks
from stagewise.passes.simulate import simulate
from tests.harness.measured import measured_cost, stream_orders
from tests.harness.ranks import spawn
from tests.models.gpt import TinyGPT, lm_loss
from tests.models.mlp import mlp
from tests.reference import (
    ADAMW,
    ATOL,
    RTOL,
    SGD,
    assert_state_equal,
    check_equal_training,
    eager_train,
    pipeline_train,
    token_batches,
)

# ---------------------------------------------------------------- a model where 2-1 is fastest


class Repeat(nn.Module):
    """Much compute on few weights: one Linear applied `times` times (one layer, no cut inside)."""

    def __init__(self, width: int, times: int):
        super().__init__()
        self.linear, self.times = nn.Linear(width, width), times

    def forward(self, x):
        for _ in range(self.times):
            x = torch.tanh(self.linear(x))
        return x


class Wide(nn.Module):
    """Many weights and little compute: adds rows of a large table (costly to all-reduce)."""

    def __init__(self, width: int, rows: int):
        super().__init__()
        self.table = nn.Parameter(torch.randn(rows, width) * 0.01)

    def forward(self, x):
        return x + self.table[: x.shape[0]]


def heavy_then_wide() -> nn.Sequential:
    """Replicating the heavy front halves the slowest stage for an all-reduce of 18 KiB; replicating
    the 1 MiB table would cost more than it saves (on `fixed_machine`'s links), and a straight
    pipeline waits on the front."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 64), Repeat(64, 256), Wide(64, 4096), nn.Linear(64, 5))


@pytest.fixture
def fixed_machine(monkeypatch):
    """Four cores at full speed and 50 MB/s links: the planner's inputs that are measured otherwise.
    The links are slow enough that the table's all-reduce (1 MiB, about 28 ms over a 3-way ring)
    costs more than a third replica saves (one microbatch of the front's 512 ops, about 12 ms with
    each op's dispatch charged): at 2 GB/s (0.7 ms) replicating the whole model 3 ways is rightly
    the fastest."""
    monkeypatch.setattr("stagewise.compiler.assembly.options.computes_at_full_speed", lambda: 4.0)
    monkeypatch.setattr("stagewise.compiler.compile.costing.local_topology", lambda devices: Topology.uniform(len(devices), 5e7))


def shape_of(plan) -> tuple[int, ...]:
    """Instances per pipeline position: (2, 1) for a 2-1 plan."""
    count = Counter(s.position for s in plan.stages)
    return tuple(count[p] for p in sorted(count))


def check_routing(plan) -> None:
    """Each instance takes its own microbatches, the replicas of a stage all of them between them,
    and every send and receive moves a microbatch both ends take."""
    takes = {s.index: set(s.microbatches or range(plan.microbatches)) for s in plan.stages}
    for position in {s.position for s in plan.stages}:
        replicas = [takes[s.index] for s in plan.stages if s.position == position]
        assert sorted(mb for mine in replicas for mb in mine) == list(range(plan.microbatches))
    for program in plan.programs:
        for ins in program.instructions:
            if isinstance(ins, (Send, Recv)):
                assert ins.microbatch in takes[ins.stage] & takes[ins.peer_stage], ins


def check_replicas_summed_before_updates(plan) -> None:
    for stage in plan.stages:
        siblings = tuple(s.index for s in plan.stages if s.position == stage.position)
        if len(siblings) == 1:
            continue
        code = plan.programs[stage.device].instructions
        summed = [i for i, ins in enumerate(code) if isinstance(ins, AllReduceShared) and set(siblings) <= set(ins.group)]
        updated = [i for i, ins in enumerate(code) if isinstance(ins, Update) and ins.stage == stage.index]
        assert summed and updated and max(summed) < min(updated)


def test_the_planner_keeps_a_2_1_plan_where_it_predicts_it_faster(fixed_machine) -> None:
    """replicas="per-stage": the DP replicates the heavy front on two devices, the simulator predicts
    that faster than the straight pipeline (and than replicating the table too), and the plan trains
    like eager training."""
    batches = [((torch.randn(32, 8),), torch.randint(0, 5, (32,))) for _ in range(2)]
    pipe = check_equal_training(heavy_then_wide(), batches, 3, loss_fn=F.cross_entropy, optimizer=SGD, microbatches=8,
                                schedule="1f1b", replicas="per-stage", cost="analytic")
    assert shape_of(pipe.plan) == (2, 1)
    straight, replicated = pipe.plan.considered
    assert "replicas 2-1 (PipeDream DP)" in replicated and "replicas" not in straight
    times = [float(line.split("ms/iteration")[0].split()[-1]) for line in (straight, replicated)]
    assert pipe.plan.predicted_iteration_s * 1e3 == pytest.approx(times[1], abs=0.01) and times[1] < times[0]
    check_routing(pipe.plan)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("problem", ["mlp-sgd", "tied-gpt-adamw"])
def test_a_2_1_plan_trains_like_eager(schedule: str, problem: str) -> None:
    """replicas=(2, 1): stage 0 on devices 0 and 1 (even and odd microbatches), stage 1 on device 2.
    On the tied GPT the embedding's gradient is summed over both replicas and the LM head."""
    if problem == "mlp-sgd":
        torch.manual_seed(0)
        batches = [((torch.randn(8, 8),), torch.randint(0, 5, (8,))) for _ in range(3)]
        model, options = mlp(), dict(loss_fn=F.cross_entropy, optimizer=SGD)
    else:
        batches = token_batches(3, batch=8)
        model, options = TinyGPT(layers=4), dict(loss_fn=lm_loss, optimizer=ADAMW, clip_grad_norm=0.5)
    pipe = check_equal_training(model, batches, 3, microbatches=4, schedule=schedule, replicas=(2, 1), cost="analytic",
                                **options)
    plan = pipe.plan
    assert shape_of(plan) == (2, 1)
    assert [(s.device, s.replica, s.microbatches) for s in plan.stages] == [(0, 0, (0, 2)), (1, 1, (1, 3)), (2, 0, ())]
    validate(plan.programs)
    check_routing(plan)
    check_replicas_summed_before_updates(plan)


def test_the_simulator_runs_a_2_1_plan_as_the_runtime_does() -> None:
    """The differential check of tests/test_differential.py on a 2-1 plan: per device the bytes sent,
    and every stream's order of instructions."""
    batches = token_batches(1, batch=8)
    pipe = sw.compile(TinyGPT(layers=4), [sw.Device("cpu") for _ in range(3)], batches[0][0], loss_fn=lm_loss,
                      example_target=batches[0][1], optimizer=ADAMW, microbatches=4, schedule="1f1b", replicas=(2, 1),
                      cost="analytic")
    pipe.step(*batches[0][0], target=batches[0][1])
    before = [s["p2p_bytes"] for s in pipe.stats]
    pipe.step(*batches[0][0], target=batches[0][1])
    sent = [s["p2p_bytes"] - b for s, b in zip(pipe.stats, before, strict=True)]
    predicted = simulate(pipe.plan.programs, measured_cost(pipe), opportunistic=False)
    assert sent == [predicted.p2p_bytes[d] for d in range(3)] and sent[2] > 0
    simulated: dict[tuple[int, Stream], list[int]] = {}
    for span in predicted.timeline:
        simulated.setdefault((span.device, span.stream), []).append(span.index)
    assert stream_orders(pipe) == simulated


def test_a_2_1_pipeline_saves_loads_and_trains_on_identically(tmp_path) -> None:
    batches = token_batches(4, batch=8)
    pipe = sw.compile(TinyGPT(layers=4), 3, batches[0][0], loss_fn=lm_loss, example_target=batches[0][1],
                      optimizer=ADAMW, microbatches=4, schedule="1f1b", replicas=(2, 1), cost="analytic")
    pipeline_train(pipe, batches[:2])
    pipe.save(tmp_path / "ck")
    loaded = sw.load(tmp_path / "ck")
    assert loaded.plan.to_json() == pipe.plan.to_json() and shape_of(loaded.plan) == (2, 1)
    torch.testing.assert_close(torch.stack(pipeline_train(loaded, batches[2:])),
                               torch.stack(pipeline_train(pipe, batches[2:])), rtol=0, atol=0)
    assert_state_equal(loaded.state_dict(), pipe.state_dict())


def _train_2_1_on_three_ranks(rank: int, init_file: str, out: str) -> None:
    """One rank of three: the tied GPT on a 2-1 plan with clipping; saves its losses and the state."""
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=3,
                            timeout=datetime.timedelta(seconds=30))
    torch.set_num_threads(1)
    try:
        model, batches, options = _tied_gpt_problem()
        pipe = sw.compile(model, 3, batches[0][0], example_target=batches[0][1], schedule="1f1b", replicas=(2, 1),
                          cost="analytic", **options)
        pipe.timeout_s = 20.0
        losses = pipeline_train(pipe, batches)
        result = {"losses": losses, "state": {k: v.clone() for k, v in pipe.state_dict().items()},
                  "devices": {w.stage.device for w in pipe._workers}}
    except Exception:  # noqa: BLE001 - the parent shows it
        result = {"error": traceback.format_exc()}
    (Path(out) / f"rank{rank}.pkl").write_bytes(pickle.dumps(result))
    os._exit(0)  # a failed rank may leave the group mid-collective: do not wait on it at exit


def _tied_gpt_problem():
    """(model, batches, options) the ranks and the parent build alike, from seed 0."""
    torch.manual_seed(0)
    batches = token_batches(3, batch=8)
    return TinyGPT(layers=4), batches, dict(loss_fn=lm_loss, optimizer=ADAMW, microbatches=4, clip_grad_norm=0.5)


def test_a_2_1_plan_trains_like_eager_on_three_ranks(tmp_path) -> None:
    """Under torch.distributed each rank runs its own instance: replica 0 or 1 of stage 0, or stage 1."""
    results = spawn(_train_2_1_on_three_ranks, tmp_path, ranks=3)
    for rank, result in enumerate(results):
        assert result is not None and "error" not in result, (rank, result)
        assert result["devices"] == {rank}
    model, batches, options = _tied_gpt_problem()
    want = eager_train(model, batches, **options)
    for result in results:
        torch.testing.assert_close(torch.stack(result["losses"]), torch.stack(want), rtol=RTOL, atol=ATOL)
        assert_state_equal(result["state"], model.state_dict())


@pytest.mark.parametrize(("kwargs", "error", "match"), [
    (dict(replicas=(2, 0)), sw.PlanError, "replicas must be"),
    (dict(replicas=(2, 1), stages=2), sw.PlanError, "drop stages="),
    (dict(replicas="per-stage", split_points=["blocks.1"]), sw.PlanError, "give each stage's replicas"),
    (dict(replicas=(2, 2)), sw.PartitionError, "need 4 devices, there are 3"),
    (dict(replicas=(2, 1), schedule="varuna"), sw.PartitionError, "varuna cannot run stages replicated"),
    (dict(replicas=(2, 1), split_points=["blocks.0", "blocks.2"]), sw.PartitionError, "one count per stage"),
    (dict(replicas=(5, 1), microbatches=4), sw.BatchSizeError, "only 4 microbatches"),
])
def test_bad_per_stage_replicas_are_clear_errors(kwargs, error, match) -> None:
    ids = torch.randint(0, 64, (8, 8))
    options = {"microbatches": 4, "schedule": "1f1b", **kwargs}
    devices = 6 if kwargs.get("replicas") == (5, 1) else 3
    with pytest.raises(error, match=match):
        sw.compile(TinyGPT(), devices, (ids,), loss_fn=lm_loss, example_target=ids, cost="analytic", **options)


# ---------------------------------------------------------------- plans built by hand, simulated

def chain(compute: list[float], weights: list[float], activation: float,
          replicas: tuple[int, ...], starts: tuple[int, ...], microbatches: int, schedule: str = "1f1b"):
    """Programs and charges of a chain of layers cut at `starts`, stage s on replicas[s] devices:
    the product's replication, schedule, lowering and charging, without a model."""
    n = len(compute)
    bounds = [*starts, n]
    stages = tuple(Stage(s, s, tuple(range(bounds[s], bounds[s + 1])), (f"a{s - 1}",) if s else (),
                         (f"a{s}",) if s + 1 < len(starts) else ("loss",), tuple(f"w{i}" for i in range(bounds[s], bounds[s + 1])), ())
                   for s in range(len(starts)))
    transfers = tuple(Transfer(f"a{s}", s, s + 1, activation, True) for s in range(len(starts) - 1))
    firsts = list(itertools.accumulate((0, *replicas)))
    devices = [tuple(range(firsts[s], firsts[s] + r)) for s, r in enumerate(replicas)]
    instances, copies = replicate_stages(stages, transfers, devices, microbatches)
    shared = tuple(SharedTensor(f"w{i}", (f"w{i}",), tuple(x.index for x in instances if x.position == s), "parameter",
                                int(weights[i]))
                   for s in range(len(starts)) if replicas[s] > 1 for i in stages[s].layers)
    tasks = instance_tasks(schedule, instances, microbatches, sum(replicas), jit_update=True)
    programs = lower(instances, copies, shared, tasks, False)
    costs = [LayerCost(i, 1, t / 3, 2 * t / 3, t / 3, int(weights[i]), 0, 0, 0, 0, 0) for i, t in enumerate(compute)]
    charges = stage_charges(instances, copies, (), costs, [DeviceSpec("gpu", "cuda")] * sum(replicas), 1,
                            Topology.uniform(sum(replicas), BANDWIDTH), shared=shared)
    return programs, charges


BANDWIDTH = 1000.0  # bytes/s of every link in the hand-built comparisons


@pytest.mark.parametrize(("front_weights", "dp_replicates", "simulator_replicates"), [
    (100.0, True, True),  # a cheap all-reduce: both models replicate the heavy front
    (10_000.0, False, True),  # the DP charges the all-reduce per input, our flushed schedules once per step
    (100_000.0, False, False),  # an all-reduce longer than the step it would save: both keep the straight pipeline
])
def test_when_a_2_1_plan_beats_the_straight_pipeline(front_weights, dp_replicates, simulator_replicates) -> None:
    """Three layers of 6, 1.5 and 1.5 s on 3 devices, 8 microbatches: straight, the front's 6 s is the
    bottleneck; 2-1 halves it for an all-reduce of the front's weights. PipeDream's model (T^k of
    §2.4.1: max(compute / r, all-reduce) per input, for asynchronous weight updates) and our
    simulator (the all-reduce once per flushed step) agree at both ends and differ in between,
    where the planner, which scores every candidate by simulation, keeps the 2-1 plan."""
    compute, weights, m = [6.0, 1.5, 1.5], [front_weights, 5000.0, 5000.0], 8
    profile = LayerCosts(compute=compute, activation_bytes=[1.0, 1.0, 0.0], param_bytes=weights)
    dp = plan_pipeline(profile, Topology.uniform(3, BANDWIDTH))
    straight = plan_pipeline(profile, Topology.uniform(3, BANDWIDTH), straight=True)
    two_one = plan_with_replicas(profile, Topology.uniform(3, BANDWIDTH), (2, 1))
    assert two_one.stages == (StageSpan(0, 0, 2), StageSpan(1, 2, 1))
    assert (dp.stages == two_one.stages) == dp_replicates
    assert two_one.bottleneck == pytest.approx(max(3.0, 2 * front_weights / BANDWIDTH))
    simulated = {}
    for name, replicas, starts in (("1-1-1", (1, 1, 1), (0, 1, 2)), ("2-1", (2, 1), (0, 1))):
        programs, charges = chain(compute, weights, 1.0, replicas, starts, m)
        simulated[name] = simulate(programs, charges).iteration_time
    assert (simulated["2-1"] < simulated["1-1-1"]) == simulator_replicates
    assert simulated["1-1-1"] >= m * straight.bottleneck  # no schedule beats its slowest stage
    assert simulated["2-1"] >= m * 3.0 + front_weights / BANDWIDTH  # nor the front's half, then its all-reduce


@pytest.mark.parametrize("seed", range(30))
def test_replicated_stage_schedules_run_to_the_end(seed: int) -> None:
    """Any replication and microbatch count: the programs validate and simulate without a deadlock,
    with every instance computing exactly its own microbatches."""
    rng = random.Random(seed)
    replicas = tuple(rng.randint(1, 3) for _ in range(rng.randint(1, 4)))
    m = rng.randint(max(replicas), 9)
    schedule = rng.choice(["gpipe", "1f1b"])
    programs, charges = chain([1.0] * len(replicas), [4.0] * len(replicas), 1.0, replicas, tuple(range(len(replicas))),
                              m, schedule)
    validate(programs)
    assert math.isfinite(simulate(programs, charges).iteration_time)
    forwards: dict[int, list[int]] = {}
    for program in programs:
        for ins in program.instructions:
            if isinstance(ins, Forward):
                forwards.setdefault(program.device, []).append(ins.microbatch)
    firsts = list(itertools.accumulate((0, *replicas)))
    for position, ways in enumerate(replicas):
        for r in range(ways):  # device firsts[position] + r runs replica r: the microbatches k = r mod ways
            assert sorted(forwards[firsts[position] + r]) == list(range(r, m, ways)), (replicas, m)


def test_1f1b_rr_keeps_noam_inputs_in_flight() -> None:
    """§2.4.2: a replica of a stage on r of the w devices from it on admits ceil(w / r) inputs; on 2-1
    each front replica warms up with one forward, the back stage alternates from the start."""
    stages = tuple(Stage(s, s, (s,), (), (), (), ()) for s in range(2))
    instances, _ = replicate_stages(stages, (), [(0, 1), (2,)], 6)
    tasks = instance_tasks("1f1b", instances, 6, 3, jit_update=True)
    spelled = [" ".join(f"{t.phase.value}{'' if t.microbatch is None else t.microbatch}" for t in d) for d in tasks]
    assert spelled == ["F0 F2 B0 F4 B2 B4 U", "F1 F3 B1 F5 B3 B5 U", "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 U"]


class _Untraceable(torch.nn.Linear):
    """A model whose forward fails: a compile that reaches the trace says so."""

    def forward(self, x):
        raise RuntimeError("the model was traced")


@pytest.mark.parametrize(("kwargs", "match"), [
    (dict(replicas=(2, 2)), "need 4 devices, there are 3"),
    (dict(replicas=(2, 1), schedule="varuna"), "varuna cannot run stages replicated"),
    (dict(replicas=(2, 1), split_points=["a", "b"]), "one count per stage"),
    (dict(schedule="interleaved", stages=2), "interleaved places its own"),
    (dict(schedule="zb-v", replicas=3), "zb-v schedule runs without data-parallel replicas"),
])
def test_layout_contradictions_are_refused_before_the_model_is_traced(kwargs, match) -> None:
    """Known from the options and the device count alone: refused at once, not after torch.export."""
    x = torch.randn(8, 4)
    with pytest.raises(sw.PartitionError, match=match):
        sw.compile(_Untraceable(4, 4), 3, (x,), loss_fn=lambda out, y: out.sum(), example_target=x, **kwargs)


@pytest.mark.parametrize(("kwargs", "match"), [
    (dict(replicas=3, microbatches=2, schedule="1f1b"), "3 data-parallel replicas need microbatches divisible by 3"),
    (dict(replicas=3, microbatches=4), "3 data-parallel replicas need microbatches divisible by 3"),
    (dict(replicas=(2, 1), microbatches=1), "stage 0 has 2 replicas but there are only 1 microbatches"),
])
def test_replicas_the_microbatches_cannot_share_are_refused_before_the_model_is_traced(kwargs, match) -> None:
    """More replicas than microbatches (or D pipelines that cannot split them evenly): known from the
    options alone, refused at once (passes/replicate.py found them only after torch.export)."""
    x = torch.randn(8, 4)
    with pytest.raises(sw.BatchSizeError, match=match):
        sw.compile(_Untraceable(4, 4), 3, (x,), loss_fn=lambda out, y: out.sum(), example_target=x, **kwargs)
