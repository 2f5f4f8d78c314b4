"""Crafted checkpoints run nothing: an attacker rewrites a checkpoint's data (stage_<i>.json,
graph.json, training.pt) and its marker consistently, as anyone can (sizes and SHA-256 are
public), to name code that would run a shell, Python source, a file write or an exit. Every entry
point that reads the data (`sw.load`, `sw.load(devices=3)`'s re-plan, `pipe.restore`, `stagewise
inspect`) refuses it with a CheckpointError naming the file and the entry, and the payload's
canary file is never made (codegen/allowlist.py, compiler/checkpoint/verify.py)."""

from __future__ import annotations

import functools
import io
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import stagewise as sw
from stagewise.cli.main import main
from stagewise.ir.errors import CheckpointError
from tests.harness.crafted import crafted, with_node
from tests.models.gpt import TinyGPT, lm_loss

CANARY = "canary"  # the file a payload makes, in the test's own folder


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[sw.Pipeline, Path]:
    """A small fx-traced pipeline on two CPU devices, saved once (graph.json included)."""
    torch.manual_seed(0)
    tokens = torch.randint(0, 64, (4, 8))
    pipe = sw.compile(TinyGPT(layers=2), ["cpu", "cpu"], (tokens,), loss_fn=lm_loss, example_target=tokens,
                      cost="analytic", optimizer=functools.partial(torch.optim.SGD, lr=0.1))
    path = tmp_path_factory.mktemp("attacks") / "ckpt"
    pipe.save(path)
    return pipe, path


def _payloads(canary: str) -> dict[str, dict]:
    """Nodes that run code, write files or exit (each would make `canary` or call os._exit)."""
    touch = f"touch {canary}"
    opens = f"open({canary!r}, 'w').close()"
    return {
        "collect_env.run": {"target": {"function": ["torch.utils.collect_env", "run"]}, "args": [touch]},
        "collect_env.subprocess": {"target": {"function": ["torch.utils.collect_env.subprocess", "getoutput"]},
                                   "args": [touch]},
        "forward_from_src": {"target": {"function": ["torch.fx.graph_module", "_forward_from_src"]},
                             "args": [opens, {"dict": []}]},
        "torch.os.mkdir": {"target": {"function": ["torch.os", "mkdir"]}, "args": [canary]},
        "torch.os._exit": {"target": {"function": ["torch.os", "_exit"]}, "args": [0]},
        "torch.sys.exit": {"target": {"function": ["torch.sys", "exit"]}, "args": [0]},
        "eval": {"target": {"function": ["builtins", "eval"]}, "args": [opens]},
        "exec": {"target": {"function": ["builtins", "exec"]}, "args": [opens]},
        "__import__": {"target": {"function": ["builtins", "__import__"]}, "args": ["os"]},
        "open": {"target": {"function": ["builtins", "open"]}, "args": [canary, "w"]},
        "attrgetter": {"target": {"function": ["_operator", "attrgetter"]}, "args": ["__class__"]},
        "aten.from_file": {"target": {"op": "aten.from_file.default"}, "args": [canary, True, 8]},
        "other-op-namespace": {"target": {"op": "prims.view_of.default"}, "args": ["X"]},
        "getattr-dunder": {"target": {"function": ["builtins", "getattr"]}, "args": ["X", "__class__"]},
        "getattr-storage": {"target": {"function": ["builtins", "getattr"]}, "args": ["X", "untyped_storage"]},
        "method-reduce": {"op": "call_method", "target": "__reduce__", "args": ["X"]},
        "method-class": {"op": "call_method", "target": "__class__", "args": ["X"]},
        "method-storage": {"op": "call_method", "target": "untyped_storage", "args": ["X"]},
        "enum-any-class": {"target": {"function": ["torch", "relu"]},
                           "args": [{"enum": ["torch.utils.collect_env.subprocess", "Popen", "args"]}]},
        "annotation-any-class": {"target": {"function": ["torch", "relu"]}, "args": ["X"],
                                 "type": {"function": ["torch.utils.collect_env.subprocess", "Popen"]}},
    }


PAYLOADS = list(_payloads(CANARY))


@pytest.fixture
def canary(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The canary's path; the working folder is the test's, and os._exit only makes the canary."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(os, "_exit", lambda status: (tmp_path / CANARY).touch())
    monkeypatch.setattr(sys, "exit", lambda status=0: (tmp_path / CANARY).touch())
    return tmp_path / CANARY


def _inspect(path: Path, capsys: pytest.CaptureFixture) -> str:
    """`stagewise inspect`, which must refuse with exit status 2 and one line: that line."""
    assert main(["inspect", str(path)]) == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("payload", PAYLOADS)
@pytest.mark.parametrize("file", ["stage_0.json", "graph.json"])
def test_a_crafted_call_is_refused_and_runs_nothing(saved, payload: str, file: str, canary: Path, tmp_path: Path,
                                                    capsys: pytest.CaptureFixture):
    crafted_path = crafted(saved[1], tmp_path, file, with_node(_payloads(str(canary))[payload]))
    for load in (lambda: sw.load(crafted_path), lambda: sw.load(crafted_path, devices=["cpu"] * 3)):
        with pytest.raises(CheckpointError, match=rf"{file} is whole but cannot be used: node 'payload': "):
            load()
    assert f"{file} is whole but cannot be used: node 'payload': " in _inspect(crafted_path, capsys)
    assert not canary.exists()


def test_a_leaf_module_class_outside_torch_nn_leaves_is_refused(saved, tmp_path: Path, capsys: pytest.CaptureFixture):
    def rewrite(data: bytes) -> bytes:
        structure = json.loads(data)
        structure["modules"]["leaf"] = {"class": ["torch.nn.parallel.distributed", "DistributedDataParallel"],
                                        "arguments": {}, "training": True, "rebuildable": True}
        return json.dumps(structure).encode()

    crafted_path = crafted(saved[1], tmp_path, "stage_0.json", rewrite)
    message = r"stage_0\.json is whole but cannot be used: the leaf module leaf: .*DistributedDataParallel, which is not"
    with pytest.raises(CheckpointError, match=message):
        sw.load(crafted_path)
    assert "DistributedDataParallel, which is not" in _inspect(crafted_path, capsys)


def with_optimizer(class_path: str) -> Callable[[bytes], bytes]:
    """training.pt naming `class_path` as the optimizer's class."""

    def rewrite(data: bytes) -> bytes:
        training = torch.load(io.BytesIO(data), weights_only=True)
        training["optimizer"]["class"] = class_path
        buffer = io.BytesIO()
        torch.save(training, buffer)
        return buffer.getvalue()

    return rewrite


@pytest.mark.parametrize("class_path", ["os.system", "evil_optimizer.SGD", "torch.utils.collect_env.run"])
def test_an_optimizer_class_is_never_imported(saved, class_path: str, canary: Path, tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture):
    """Even a module next to the checkpoint, its folder on sys.path, is never imported."""
    (tmp_path / "evil_optimizer.py").write_text(f"open({str(canary)!r}, 'w').close()\nfrom torch.optim import SGD\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    crafted_path = crafted(saved[1], tmp_path, "training.pt", with_optimizer(class_path))
    says = rf"training\.pt \(key 'optimizer'\) names the optimizer class '{class_path}'.*trusted_functions="
    for load in (lambda: sw.load(crafted_path), lambda: sw.load(crafted_path, devices=["cpu"] * 3)):
        with pytest.raises(CheckpointError, match=says):
            load()
    assert "names the optimizer class" in _inspect(crafted_path, capsys)
    with pytest.raises(CheckpointError, match=f"holds {class_path}'s optimizer state"):
        saved[0].restore(crafted_path)
    assert not canary.exists() and "evil_optimizer" not in sys.modules


def test_a_trusted_optimizer_class_of_ones_own_loads(saved, tmp_path: Path):
    """The refusal's advice works: the class passed in trusted_functions is the one loaded."""

    crafted_path = crafted(saved[1], tmp_path, "training.pt", with_optimizer(f"{__name__}.OwnSGD"))
    with pytest.raises(CheckpointError, match=r"trusted_functions=\[OwnSGD\]"):
        sw.load(crafted_path)
    pipe = sw.load(crafted_path, trusted_functions=[OwnSGD])
    assert all(type(w.optimizer) is OwnSGD for w in pipe._runtime.workers)


class OwnSGD(torch.optim.SGD):
    """An optimizer class of the user's own: loads only when trusted."""
