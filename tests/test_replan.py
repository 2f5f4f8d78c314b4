"""`sw.load(directory, devices=...)` plans a checkpoint's graph again for other devices, without the
model (compiler/elastic/replan.py, Varuna §4.5). Hugging Face GPT-2 (a torch.export graph) from 4 devices
onto 2 and 3: tests/test_morph.py; under two gloo ranks: tests/test_distributed_training_api.py."""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch

import stagewise as sw
from stagewise.compiler.assembly.optimizer_recipe import recorded_optimizer
from stagewise.compiler.checkpoint.read import read_checkpoint
from stagewise.compiler.compile import costing
from stagewise.compiler.compile.calibrate import OptimizerCost
from stagewise.compiler.elastic.replan import _options
from stagewise.ir.topology import Topology
from tests import hf
from tests.models.dropout import DropoutGPT
from tests.models.gpt import lm_loss
from tests.reference import ADAMW

STEPS = 3
# slow enough that FLOPs, not each op's dispatch, decide a block's time: 4 of them pipeline microbatches
FLOP_BOUND = sw.Device("cpu", peak_flops="5GFLOPS")


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(5)
    out = []
    for _ in range(2 * STEPS):
        ids = torch.randint(0, 64, (32, 9), generator=generator)
        out.append((ids[:, :-1], ids[:, 1:]))
    return out


def _compiled(devices: int | list[sw.Device]) -> sw.Pipeline:
    """The tied GPT (fx-traced), no dropout: the planner chooses the microbatch count and schedule."""
    torch.manual_seed(0)
    ids, target = _batches()[0]
    pipe = sw.compile(DropoutGPT(p=0.0, layers=2), devices, (ids,), loss_fn=lm_loss, example_target=target, cost="analytic",
                      optimizer=ADAMW, clip_grad_norm=1.0)
    pipe.timeout_s = 20.0
    return pipe


@pytest.fixture(scope="module")
def fixed_runtime_costs():
    """The figures analytic planning measures on this machine (the per-instruction hand-off, the
    optimizer step, the links, the cores in-process devices compute on at once), fixed: the
    microbatch counts the planner chooses are then the model's, not the machine's (a hand-off slowed
    by load, or 4 devices sharing 2 cores, made the 4-device plan choose 1 microbatch, as the
    1-device plan does)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("stagewise.compiler.assembly.options.computes_at_full_speed", lambda: 4.0)
        patch.setattr(costing, "handoff_seconds", lambda: 1.1e-5)
        patch.setattr(costing, "optimizer_cost", lambda *_: OptimizerCost(per_tensor_s=3e-5, per_byte_s=1e-9))
        patch.setattr(costing, "local_topology", lambda devices: Topology.uniform(len(devices), 32e9))
        yield


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory, fixed_runtime_costs):
    """Trained STEPS steps on 4 devices, saved, then STEPS more: what a re-planned run must match."""
    pipe = _compiled([FLOP_BOUND] * 4)
    batches = _batches()
    for ids, target in batches[:STEPS]:
        pipe.step(ids, target=target)
    directory = tmp_path_factory.mktemp("replan") / "ck"
    pipe.save(directory)
    losses = [pipe.step(ids, target=target) for ids, target in batches[STEPS:]]
    return directory, losses, pipe.state_dict()


def test_an_fx_graph_is_planned_again_at_any_microbatch_count_and_again_from_its_own_checkpoint(
        saved_run, fixed_runtime_costs, tmp_path):
    """Onto one device (the planner free to choose the microbatches: fx code takes any size), one
    step there, saved, and onto two: each checkpoint keeps the graph, and the run ends as the
    uninterrupted one within fp32 rounding."""
    directory, want_losses, want_state = saved_run
    batches = _batches()[STEPS:]
    one = sw.load(directory, devices=["cpu"], report=False)
    assert len(one.plan.devices) == 1 and one.plan.tracer == "fx"
    assert one.plan.microbatches != read_checkpoint(directory, None).plan.microbatches  # 1 here, more on 4 devices
    losses = [one.step(batches[0][0], target=batches[0][1])]
    one.save(tmp_path / "one")
    two = sw.load(tmp_path / "one", devices=["cpu", "cpu"], report=False)
    assert len(two.plan.devices) == 2 and two._executor.state.iteration == STEPS + 1
    losses += [two.step(ids, target=target) for ids, target in batches[1:]]
    torch.testing.assert_close(torch.stack(losses), torch.stack(want_losses), rtol=1e-5, atol=1e-6)
    got = two.state_dict()
    assert list(got) == list(want_state)
    for key, tensor in want_state.items():
        torch.testing.assert_close(got[key], tensor, rtol=1e-4, atol=1e-6, msg=key)


def test_an_export_graph_is_planned_at_microbatches_no_larger_than_saved(tmp_path):
    """Hugging Face Llama (torch.export) saved as one microbatch of 16 on two devices, planned again
    for three devices of too little memory for that: more, smaller microbatches (the saved code
    takes any size down to its smallest), never larger ones; the loss is the saved run's. Its graph
    reads constants (rotary inv_freq, lifted masks) that only the checkpoint's constants hold:
    checkpoint_limits.check_declared finds each, so a legitimate checkpoint with them loads."""
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 128, (16, 8), generator=generator)
    torch.manual_seed(0)
    pipe = sw.compile(hf.llama(2), 2, {"input_ids": ids, "labels": ids}, cost="analytic", optimizer=ADAMW)
    pipe.step(input_ids=ids, labels=ids)
    pipe.save(tmp_path / "ck")
    assert (pipe.plan.microbatches, pipe.plan.microbatch_size) == (1, 16)
    saved = read_checkpoint(tmp_path / "ck", None)
    constants = {key.removeprefix("constants.") for key in saved.tensors if key.startswith("constants.")}
    assert "model.rotary_emb.inv_freq" in constants and constants <= set(saved.model_graph["graph"]["tensors"])
    options = _options(saved.model_graph, saved.plan, saved.training, None)
    assert options.microbatches is None and options.microbatch_sizes == (saved.plan.smallest_microbatch, 16)
    moved = sw.load(tmp_path / "ck", devices=[sw.Device("cpu", memory="300KiB")] * 3, report=False)
    assert moved.plan.microbatches > 1 and moved.plan.microbatch_size >= moved.plan.smallest_microbatch
    torch.testing.assert_close(moved.step(input_ids=ids, labels=ids), pipe.step(input_ids=ids, labels=ids),
                               rtol=1e-5, atol=1e-6)


def test_an_fx_graph_takes_any_microbatch_size(saved_run):
    saved = read_checkpoint(saved_run[0], None)
    assert _options(saved.model_graph, saved.plan, saved.training, None).microbatch_sizes is None


def test_a_checkpoint_without_a_graph_is_placed_as_saved_or_refused(tmp_path):
    """A graph that could not be saved as data: the saved plan's devices go onto the new ones (told
    in a warning), and asking for a new plan names the way through the model."""
    pipe = _compiled(2)
    pipe._model_graph = {"format": "stagewise.model/1", "unavailable": "a tensor subclass"}
    pipe.save(tmp_path / "ck")
    with pytest.warns(UserWarning, match="a tensor subclass"):
        placed = sw.load(tmp_path / "ck", devices=["cpu"])
    assert len(placed.plan.devices) == 2 and {d.name for d in placed.plan.devices} == {"cpu"}
    with pytest.raises(sw.CheckpointError, match="a tensor subclass.*pipe.restore"):
        sw.load(tmp_path / "ck", devices=["cpu"], replan=True)
    with pytest.raises(sw.OptionError, match="give them"):
        sw.load(tmp_path / "ck", replan=True)


def test_the_same_devices_load_the_saved_plan_and_virtual_devices_are_placed(saved_run, tmp_path):
    directory = saved_run[0]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        same = sw.load(directory, devices=[FLOP_BOUND] * 4)
    assert same.plan == read_checkpoint(directory, None).plan  # not planned again
    assert not [w for w in caught if "graph" in str(w.message)]
    torch.manual_seed(0)
    ids, target = _batches()[0]
    virtual = sw.compile(DropoutGPT(p=0.0, layers=2), ["cpu"], (ids,), loss_fn=lm_loss, example_target=target,
                         cost="analytic", virtual_devices=2, microbatches=2)
    virtual.save(tmp_path / "virtual")
    placed = sw.load(tmp_path / "virtual", devices=["cpu", "cpu"])
    assert dataclasses.replace(placed.plan, devices=virtual.plan.devices) == virtual.plan


def test_saved_groups_place_a_tie_under_any_of_its_names_and_refuse_a_stranger():
    """A stage may know a tied parameter by another name than the one saved (the canonical name is
    the first the model registered): it takes that name's group. A parameter the saved groups never
    held would otherwise land in some group silently: refused."""
    groups = [{"param_names": ["h.bias"], "weight_decay": 0.0, "lr": 0.01},
              {"param_names": ["wte.weight", "h.weight"], "weight_decay": 0.1, "lr": 0.01}]
    factory = recorded_optimizer({"class": "torch.optim.AdamW", "defaults": {"lr": 0.01}}, groups,
                                 (("wte.weight", "head.weight"),))
    tied, bias = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2))
    optimizer = factory.build([("head.weight", tied), ("h.bias", bias)])
    assert [g["params"] for g in optimizer.param_groups] == [[bias], [tied]]
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.0, 0.1]
    with pytest.raises(sw.CheckpointError, match="do not hold the parameter extra.weight"):
        factory.build([("extra.weight", torch.nn.Parameter(torch.ones(1)))])
