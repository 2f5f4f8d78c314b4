"""training.pt's entries, rewritten by an attacker who reseals the marker, are refused where the
checkpoint is read (every entry point: load, re-plan, restore, inspect), naming the file and the
entry, and the pipeline a refused restore was called on trains on as before. Before, each reached
the runtime as a raw TypeError or KeyError mid-load, or (a stage listed as swapped) failed the next
step midway. A value of the wrong kind for the optimizer or the scheduler the user made is refused
too, and the scheduler is left as it was.
"""

from __future__ import annotations

import copy
import io
import shutil
from pathlib import Path

import pytest
import torch

import stagewise as sw
from tests.harness.crafted import ENTRIES, compiled, quiet_load, refused, reseal

X, Y = torch.randn(4, 8, generator=torch.Generator().manual_seed(1)), torch.tensor([0, 1, 2, 3])

CRAFTED = {  # entry -> a value stagewise never writes there
    "step": "3", "clip_grad_norm": float("nan"), "extra": [1], "scheduler": 7, "mode_training": "train",
    "loss_reduction": {"kind": "TokenMean", "zz": 1}, "optimizer": "SGD", "optimizer_groups": {"lr": 1},
    "optimizer_values": {"0.weight": 5}, "swapped": [1],
    "loss_scaler": {"scaling": {}, "scale": -1.0, "clean_steps": 0},
}
KINDS = {"loss_reduction": {"a": 1}, "step": -1, "swapped": [0, 0], "optimizer_groups": [{"param_names": [3]}]}


@pytest.fixture(scope="module")
def pipe() -> sw.Pipeline:
    pipe = compiled(0)
    pipe.step(X, target=Y)
    return pipe


@pytest.fixture(scope="module")
def saved(pipe, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("training") / "checkpoint"
    pipe.save(root)
    return root


def _with_entry(saved: Path, folder: Path, key: str, value: object) -> Path:
    """A copy of `saved` whose training.pt gives `key` the `value`, resealed."""
    target = folder / "crafted"
    shutil.copytree(saved, target)
    training = torch.load(target / "training.pt", weights_only=True)
    buffer = io.BytesIO()
    torch.save({**training, key: value}, buffer)
    (target / "training.pt").write_bytes(buffer.getvalue())
    reseal(target)
    return target


@pytest.mark.parametrize(("key", "value"), list(CRAFTED.items()) + list(KINDS.items()),
                         ids=list(CRAFTED) + [f"{k}-kind" for k in KINDS])
def test_a_crafted_training_entry_is_refused_naming_it(saved, tmp_path, key, value):
    with pytest.raises(sw.CheckpointError) as raised:
        quiet_load(_with_entry(saved, tmp_path, key, value))
    assert "training.pt" in str(raised.value) and f"{key}=" in str(raised.value)


@pytest.mark.parametrize("entry", ENTRIES)
def test_every_entry_point_refuses_it_and_a_refused_restore_changes_nothing(pipe, saved, tmp_path, capsys, entry):
    """The check sits where every entry point reads the checkpoint; the pipeline trains on after."""
    target = _with_entry(saved, tmp_path, "swapped", [1])
    before = copy.deepcopy(pipe.state_dict())
    assert "training.pt gives swapped=[1]" in refused(entry, pipe, target, capsys)
    assert all(torch.equal(before[k], v) for k, v in pipe.state_dict().items())
    pipe.step(X, target=Y)


def test_a_hyper_parameter_of_another_kind_is_refused(saved, tmp_path):
    training = torch.load(saved / "training.pt", weights_only=True)
    groups = [{**group, "lr": "0.1"} for group in training["optimizer_groups"]]
    with pytest.raises(sw.CheckpointError, match="optimizer gives lr=.0.1., where SGD takes a value like 0.001"):
        quiet_load(_with_entry(saved, tmp_path, "optimizer_groups", groups))


def test_a_scheduler_state_the_scheduler_does_not_have_is_refused_and_leaves_it_alone(pipe, tmp_path):
    scheduler = torch.optim.lr_scheduler.StepLR(pipe.optimizer, step_size=1, gamma=0.5)
    pipe.save(tmp_path / "scheduled", scheduler=scheduler)
    state = {**scheduler.state_dict(), "base_lrs": "big", "optimizer": 1}
    target = _with_entry(tmp_path / "scheduled", tmp_path / "copy", "scheduler", state)
    loaded = quiet_load(target)
    resumed = torch.optim.lr_scheduler.StepLR(loaded.optimizer, step_size=1, gamma=0.5)
    own = copy.deepcopy(resumed.state_dict())
    with pytest.raises(sw.CheckpointError, match="scheduler state gives .*'base_lrs': 'big'.*StepLR"):
        loaded.load_scheduler(resumed)
    assert resumed.state_dict() == own
    loaded.step(X, target=Y)
