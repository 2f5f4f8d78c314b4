"""Checkpoints any device set resumes (Varuna §4.5, job morphing), in torch.distributed.checkpoint.

A run saved on 4 devices goes on, restored into the same model compiled for 1 or 3, equal to
the uninterrupted run within fp32 tolerance (the reductions are over other splits), dropout on:
its masks are keyed by step, op and microbatch, not by the plan. Plain PyTorch reads the weights
into the original model with `torch.distributed.checkpoint.load` alone. Loading runs nothing from
the checkpoint: a DCP metadata or training state whose pickle would run code is refused.
(Under two gloo ranks: tests/test_distributed_training_api.py.)
"""

from __future__ import annotations

import functools
import io
import json
import os
import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp

import stagewise as sw
from stagewise.compiler.checkpoint.files import FileRecord, marker_text, read_marker
from tests.reference import assert_state_equal
from tests.training_problems import GROUPED, batches_of, compiled, model_of, state_of, step

SAVED_AFTER, RESUMED_FOR = 2, 2


@pytest.fixture(scope="module")
def four_device_run(tmp_path_factory):
    """GPT-2 with dropout on 4 devices: saved after two steps, then trained on uninterrupted."""
    batches = batches_of("hf-gpt2", SAVED_AFTER + RESUMED_FOR)
    pipe = compiled("hf-gpt2", batches, "1f1b", optimizer=GROUPED, dropout=0.1, devices=4, clip_grad_norm=0.5)
    for batch in batches[:SAVED_AFTER]:
        step(pipe, batch)
    directory = tmp_path_factory.mktemp("morph") / "ck"
    pipe.save(directory, extra={"epoch": 1})
    saved = state_of(pipe)
    losses = [step(pipe, batch) for batch in batches[SAVED_AFTER:]]
    return directory, batches, saved, losses, state_of(pipe), pipe.optimizer.state_dict()


@pytest.mark.parametrize("devices", [1, 3])  # 2: under two gloo ranks (tests/test_distributed_training_api.py)
def test_a_run_saved_on_four_devices_goes_on_on_fewer(four_device_run, devices, capsys):
    directory, batches = four_device_run[:2]
    pipe = compiled("hf-gpt2", batches, "1f1b" if devices > 1 else "gpipe", optimizer=GROUPED, dropout=0.1,
                    devices=devices, clip_grad_norm=0.5)
    move = pipe.restore(directory)
    assert move.changed and len(move.before.devices) == 4 and len(move.after.devices) == devices
    printed = capsys.readouterr().out
    assert "onto" in printed and "read" in printed
    assert sum(move.read_bytes) > 0
    _goes_on_as_uninterrupted(pipe, four_device_run)


@pytest.mark.parametrize("devices", [2, 3])
def test_sw_load_plans_again_for_other_devices_without_the_model(four_device_run, devices, capsys):
    """Varuna §4.5 from the checkpoint alone: its graph planned for the new devices (no model class,
    no compile call), each device reading its own stages' names."""
    directory = four_device_run[0]
    pipe = sw.load(directory, devices=["cpu"] * devices)
    pipe.timeout_s = 20.0
    assert len(pipe.plan.devices) == devices and pipe.plan.microbatches == 4  # the count compile was given
    printed = capsys.readouterr().out
    assert f"onto {devices}:" in printed and "device 1 read" in printed
    _goes_on_as_uninterrupted(pipe, four_device_run)


def test_a_new_plan_that_does_not_fit_says_how_to_plan_with_other_options(four_device_run):
    with pytest.raises(sw.CapacityError, match=r"options are the saved ones.*pipe.restore\(directory\)"):
        sw.load(four_device_run[0], devices=[sw.Device("cpu", memory="40KiB")] * 2, report=False)


def _goes_on_as_uninterrupted(pipe, four_device_run) -> None:
    """`pipe` holds the saved state and trains on as the 4-device run did, within fp32 rounding."""
    _, batches, saved, want_losses, want_state, want_optimizer = four_device_run
    assert pipe.extra == {"epoch": 1} and pipe._executor.state.iteration == SAVED_AFTER
    assert_state_equal(state_of(pipe), saved)
    losses = [step(pipe, batch) for batch in batches[SAVED_AFTER:]]
    torch.testing.assert_close(torch.stack(losses), torch.stack(want_losses), rtol=1e-5, atol=1e-6)
    got = state_of(pipe)
    for key, tensor in want_state.items():
        torch.testing.assert_close(got[key], tensor, rtol=1e-4, atol=1e-6, msg=key)
    got_optimizer = pipe.optimizer.state_dict()
    assert [g["param_names"] for g in got_optimizer["param_groups"]] == [
        g["param_names"] for g in want_optimizer["param_groups"]]
    for name, entry in want_optimizer["state"].items():
        for key, value in entry.items():
            torch.testing.assert_close(got_optimizer["state"][name][key], value, rtol=1e-4, atol=1e-6)


def test_plain_pytorch_reads_the_weights_into_the_original_model(four_device_run):
    directory, _, saved, *_ = four_device_run
    model = model_of("hf-gpt2", 0.0)
    state = model.state_dict()
    dcp.load({"model": state}, checkpoint_id=str(directory / "weights"))
    model.load_state_dict(state)
    for key, tensor in model.state_dict().items():
        assert torch.equal(tensor, saved[key]), key


def test_loading_without_the_model_rebuilds_the_saved_plan(four_device_run):
    directory, batches, saved, want_losses, *_ = four_device_run
    loaded = sw.load(directory)
    assert len(loaded.plan.devices) == 4 and loaded.extra == {"epoch": 1}
    assert_state_equal(state_of(loaded), saved)
    model = model_of("hf-gpt2", 0.0)
    model.load_state_dict(saved)
    ids = batches[0][0]["input_ids"]
    with torch.no_grad():
        torch.testing.assert_close(loaded.predict(input_ids=ids).logits, model.eval()(input_ids=ids).logits,
                                   rtol=1e-5, atol=1e-5)  # the stage data marks the model's output
    losses = [step(loaded, batch) for batch in batches[SAVED_AFTER:]]
    assert all(torch.equal(g, w) for g, w in zip(losses, want_losses, strict=True)), (losses, want_losses)


class _Runs:
    """Unpickling this calls os.system: what a malicious checkpoint would hold."""

    def __reduce__(self):
        return (os.system, ("echo pwned > pwned.txt",))


def _replace(directory, name: str, data: bytes) -> None:
    """Write `data` as `name` and re-mark the checkpoint, so only the content tells."""
    (directory / name).write_bytes(data)
    files = read_marker(directory)
    files[name] = FileRecord.of(data)
    (directory / "stagewise.json").write_text(marker_text(files))


@pytest.mark.parametrize("name", ["weights/.metadata", "training.pt"])
def test_a_checkpoint_whose_pickle_would_run_code_is_refused(tmp_path, name, monkeypatch):
    batches = batches_of("tied-gpt", 1)
    pipe = compiled("tied-gpt", batches, "1f1b")
    pipe.save(tmp_path / "ck")
    if name == "training.pt":
        buffer = io.BytesIO()
        torch.save({"step": _Runs()}, buffer)
        data = buffer.getvalue()
    else:
        data = pickle.dumps(_Runs())
    _replace(tmp_path / "ck", name, data)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(sw.CheckpointError, match="run code|cannot be used"):
        sw.load(tmp_path / "ck")
    fresh = compiled("tied-gpt", batches, "1f1b")
    with pytest.raises(sw.CheckpointError):
        fresh.restore(tmp_path / "ck")
    assert not (tmp_path / "pwned.txt").exists()


@pytest.mark.parametrize("function", [["os", "system"], ["builtins", "eval"], ["subprocess", "run"]])
def test_a_stage_structure_naming_a_function_outside_the_allowlist_is_refused(tmp_path, function):
    batches = batches_of("tied-gpt", 1)
    compiled("tied-gpt", batches, "1f1b").save(tmp_path / "ck")
    path = tmp_path / "ck" / "stage_0.json"
    structure = json.loads(path.read_text())
    call = next(n for n in structure["nodes"] if n["op"] == "call_function")
    call["target"] = {"function": function}
    _replace(tmp_path / "ck", "stage_0.json", json.dumps(structure).encode())
    with pytest.raises(sw.CheckpointError, match=function[1]):
        sw.load(tmp_path / "ck")


def test_a_graph_naming_a_function_outside_the_allowlist_is_refused(tmp_path, monkeypatch):
    """graph.json, which planning again rebuilds and the next save writes again, is held to the
    stages' allowlist, whether the load plans again or not."""
    batches = batches_of("tied-gpt", 1)
    compiled("tied-gpt", batches, "1f1b").save(tmp_path / "ck")
    structure = json.loads((tmp_path / "ck" / "graph.json").read_text())
    call = next(n for n in structure["graph"]["nodes"] if n["op"] == "call_function")
    call["target"] = {"function": ["os", "system"]}
    _replace(tmp_path / "ck", "graph.json", json.dumps(structure).encode())
    monkeypatch.chdir(tmp_path)
    for devices in (["cpu"], None):
        with pytest.raises(sw.CheckpointError, match=r"graph\.json is whole but cannot be used: .*os\.system"):
            sw.load(tmp_path / "ck", devices=devices)


def test_restoring_another_models_checkpoint_names_the_difference(four_device_run):
    directory = four_device_run[0]
    batches = batches_of("tied-gpt", 1)
    pipe = compiled("tied-gpt", batches, "1f1b")
    with pytest.raises(sw.CheckpointError, match="state_dict keys differ"):
        pipe.restore(directory)


def test_another_optimizer_takes_the_weights_alone_or_is_refused(four_device_run):
    """Adam's moments restored into SGD would be dropped without a word: refused, unless only the
    weights are asked for (fine-tuning from the checkpoint: no optimizer state, step count 0)."""
    directory, batches, saved, *_ = four_device_run
    pipe = compiled("hf-gpt2", batches, "1f1b", optimizer=functools.partial(torch.optim.SGD, lr=0.1))
    with pytest.raises(sw.CheckpointError, match=r"AdamW's optimizer state but this pipeline steps .*SGD"):
        pipe.restore(directory)
    pipe.restore(directory, report=False, training_state=False)
    assert_state_equal(state_of(pipe), saved)
    assert pipe._executor.state.iteration == 0 and pipe.extra == {} and not pipe.optimizer.state_dict()["state"]
    step(pipe, batches[0])
