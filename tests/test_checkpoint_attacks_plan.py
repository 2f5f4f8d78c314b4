"""A crafted plan.json or graph.json declares no number loading would act on unchecked, and a
name from a checkpoint file is looked up in torch's own tables only (issue #21, items 1 and 2).

As in tests/test_checkpoint_attacks_files.py (whose helpers, in tests/harness/crafted.py, these share), the
attacker rewrites any file and the marker with it: plan.json's counts, indices, shapes and dtype
names, graph.json's options, a dtype name in the weights' metadata. Each is refused as the file
is read, naming the file and entry, before the re-plan builds its example batch.
"""

from __future__ import annotations

import json
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import stagewise as sw
from tests.harness.crafted import ENTRIES, METADATA, compiled, edit_json, refused, reseal


@pytest.fixture(scope="module")
def pipe() -> sw.Pipeline:
    return compiled(0)


@pytest.fixture(scope="module")
def saved(pipe: sw.Pipeline, tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("saved") / "ck"
    pipe.save(directory)
    return directory


@pytest.fixture
def target(saved: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "ck"
    shutil.copytree(saved, copy)
    return copy


def _set(path: str, value: object) -> Callable[[dict], None]:
    """A change of plan.json's entry at `path` ("transfers.0.shape") to `value`."""
    *parents, last = path.split(".")

    def change(plan: dict) -> None:
        owner: Any = plan
        for part in parents:
            owner = owner[int(part)] if isinstance(owner, list) else owner[part]
        owner[int(last) if isinstance(owner, list) else last] = value

    return change


@pytest.fixture
def no_example_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    """The re-plan's example batch (what plan.json's sizes would allocate) is never built."""
    from stagewise.compiler.elastic import replan

    monkeypatch.setattr(replan, "_example_batch", lambda plan: pytest.fail("built an example batch"))


@pytest.mark.parametrize(("path", "value", "message"), [
    ("microbatch_size", 2 ** 40, "microbatch_size as 1099511627776"),
    ("microbatches", 2 ** 40, "microbatches as 1099511627776"),
    ("microbatches", -2, "microbatches as -2"),
    ("microbatches", 0, "microbatches as 0"),
    ("microbatches", "2", "microbatches as '2'"),
    ("smallest_microbatch", 3, "smallest_microbatch as 3"),
    ("input_specs.0.shape", [2 ** 30], "declares input_specs as"),
    ("input_specs.0.shape", [-8], "input_specs[0].shape as (-8,)"),
    ("input_specs.0.dtype", "load", "input_specs[0] gives the dtype 'load'"),
    ("transfers.0.shape", [2 ** 31, 2 ** 10], "declares transfers[0]"),
    ("transfers.0.dtype", "set_default_device", "transfers[0] ('{value}') gives the dtype 'set_default_device'"),
    ("transfers.0.dst", 7, "transfers[0] ('{value}').dst as 7"),
    ("stages.1.device", 99, "stages[1].device as 99"),
    ("stages.1.index", 0, "stages[1].index as 0"),
    ("devices", [], "the number of devices as 0"),
    ("programs", "program dev0 (1 instructions)\n    0  compute  F stage=0 mb=9", "instruction 0 (compute  F stage=0 mb=9): "
     "microbatch as 9"),
    ("programs", "program dev0 (1 instructions)\n    0  p2p_out  send stage=0 mb=0 act peer=5 peer_stage=1 [{value}]",
     "peer as 5"),
    ("programs", "program dev7 (1 instructions)\n    0  compute  F stage=0 mb=0", "programs[0].device as 7"),
    ("stages", [], "the number of stages as 0"),
])
def test_plan_json_numbers_beyond_any_plan_are_refused_before_allocating(pipe, target, capsys, no_example_batch,
                                                                        path, value, message):
    sent = json.loads((target / "plan.json").read_text())["transfers"][0]["value"]  # its name depends on the split
    edit_json(target, "plan.json", _set(path, value.format(value=sent) if isinstance(value, str) else value))
    got = refused("replan", pipe, target, capsys)
    assert str(target / "plan.json") in got and message.format(value=sent) in got


@pytest.mark.parametrize("entry", ENTRIES)
def test_a_huge_example_batch_in_plan_json_is_refused_by_every_entry(pipe, target, capsys, no_example_batch, entry):
    edit_json(target, "plan.json", _set("microbatch_size", 2 ** 23))  # 2**31 samples of 8 floats and an id: 80 GiB
    edit_json(target, "plan.json", _set("microbatches", 2 ** 8))
    got = refused(entry, pipe, target, capsys)
    assert str(target / "plan.json") in got and "declares input_specs as" in got and "4 GiB" in got


@pytest.mark.parametrize(("path", "value", "message"), [
    ("options", [1, 2], "its 'options' are [1, 2]"),
    ("options.loss_scaling", {"x": 1}, "gives the loss scaling {'x': 1}"),
    ("options.loss_scaling", {"init": -1.0}, "gives the loss scaling {'init': -1.0}"),
])
def test_graph_json_options_no_compile_takes_are_refused(pipe, target, capsys, path, value, message):
    edit_json(target, "graph.json", _set(path, value))
    got = refused("replan", pipe, target, capsys)
    assert str(target / "graph.json") in got and message in got


def lazy_name_in_the_metadata(root: Path) -> None:
    """DCP's metadata as a pickle naming torch.crafted_lazy_submodule (a dtype's place in a real one)."""
    (root / METADATA).write_bytes(b"ctorch\ncrafted_lazy_submodule\n.")
    reseal(root)


@pytest.mark.parametrize(("name", "craft"), [
    ("stage_0.json", lambda root: edit_json(root, "stage_0.json", lambda s: s["tensors"]["0.weight"].update(
        dtype="crafted_lazy_submodule"))),
    ("plan.json", lambda root: edit_json(root, "plan.json", _set("transfers.0.dtype", "crafted_lazy_submodule"))),
    (METADATA, lazy_name_in_the_metadata),
])
def test_a_torch_name_from_a_file_is_looked_up_in_torchs_own_table_only(pipe, target, capsys, monkeypatch, name,
                                                                        craft):
    """A name torch does not hold goes to `torch.__getattr__`, which imports torch's lazy submodules:
    a checkpoint's dtype name never reaches it (nor returns a function like torch.load)."""
    asked: list[str] = []

    def lazy(attribute: str) -> object:
        asked.append(attribute)
        raise AttributeError(attribute)

    craft(target)
    monkeypatch.setattr(torch, "__getattr__", lazy, raising=False)
    message = refused("load", pipe, target, capsys)
    assert str(target / name) in message and "crafted_lazy_submodule" in message and asked == []


_IMPORTED_MODULE = "stagewise_crafted_output_type"  # a module placed beside the checkpoint, on sys.path


def _defaultdict_naming_the_module() -> dict:
    context = {"default_factory_module": _IMPORTED_MODULE, "default_factory_name": "factory", "dict_context": []}
    return {"type": "collections.defaultdict", "context": context, "children_spec": []}  # as torch writes it


def _enum_naming_the_module() -> dict:
    context = [{"__enum__": True, "fqn": f"{_IMPORTED_MODULE}:Kind", "name": "A"}]
    return {"type": "builtins.dict", "context": json.dumps(context), "children_spec": [_LEAF]}


_LEAF = {"type": None, "context": None, "children_spec": []}


@pytest.mark.parametrize(("structure", "message"), [
    (_defaultdict_naming_the_module, "names the type 'collections.defaultdict', whose context torch reads by importing"),
    (_enum_naming_the_module, "which torch's reader would import a module for"),
    (lambda: {"type": "os.system", "context": None, "children_spec": []}, "names the type 'os.system'"),
    (lambda: {"type": "builtins.tuple", "context": None, "children_spec": "x"}, "holds the children 'x'"),
])
@pytest.mark.parametrize("entry", ["load", "inspect"])
def test_an_output_structure_naming_a_module_is_refused_and_imports_nothing(pipe, target, capsys, monkeypatch,
                                                                          structure, message, entry):
    """plan.json's output_spec is read by torch's pytree, whose reader imports the module a
    defaultdict's factory or an `__enum__` context names: refused before torch reads it."""
    canary = target.parent / "canary"
    (target.parent / f"{_IMPORTED_MODULE}.py").write_text(
        f"import pathlib\npathlib.Path({str(canary)!r}).touch()\nfactory = dict\n"
        "import enum\nclass Kind(enum.Enum):\n    A = 1\n")
    monkeypatch.syspath_prepend(str(target.parent))
    edit_json(target, "plan.json", _set("output_spec", json.dumps([1, structure()])))
    got = refused(entry, pipe, target, capsys)
    assert "plan.json output_spec" in got and message in got
    assert not canary.exists() and _IMPORTED_MODULE not in sys.modules
