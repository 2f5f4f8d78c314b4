"""Crafted checkpoints, as an attacker writes them: any file rewritten and the marker written again
over the files' fresh sizes and SHA-256 (both public), so only the loader's own checks can refuse
them; and each entry point that reads a checkpoint, returning its refusal."""

from __future__ import annotations

import json
import pickle
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.metadata import Metadata

import stagewise as sw
from stagewise.cli.main import main
from stagewise.compiler.checkpoint.files import MARKER, FileRecord, marker_text, read_marker
from tests.models.mlp import mlp
from tests.reference import SGD

METADATA = "weights/.metadata"
SHARD = "weights/__0_0.distcp"
ENTRIES = ["load", "replan", "restore", "inspect"]  # inspect reads the checkpoint as sw.load does, weights' metadata too


def compiled(seed: int) -> sw.Pipeline:
    """A small MLP on two CPU devices, its weights drawn from `seed`."""
    torch.manual_seed(seed)
    x, y = torch.randn(4, 8), torch.randint(0, 5, (4,))
    return sw.compile(mlp(), 2, (x,), loss_fn=torch.nn.functional.cross_entropy, example_target=y,
                      optimizer=SGD, microbatches=2, cost="analytic")


def crafted(original: Path, folder: Path, name: str, rewrite: Callable[[bytes], bytes]) -> Path:
    """A copy of `original` with file `name` rewritten and the marker written again over every
    file's fresh size and SHA-256, as an attacker would: the marker accepts the copy."""
    copy = folder / "crafted"
    shutil.copytree(original, copy)
    (copy / name).write_bytes(rewrite((copy / name).read_bytes()))
    records = {listed: FileRecord.of_file(copy / listed) for listed in read_marker(original)}
    (copy / MARKER).write_text(marker_text(records))
    return copy


def with_node(record: dict) -> Callable[[bytes], bytes]:
    """A stage or graph structure with the node `record` (named "payload") before its output."""

    def rewrite(data: bytes) -> bytes:
        document = json.loads(data)
        structure = document.get("graph", document)  # graph.json holds the structure under "graph"
        first = next(n["name"] for n in structure["nodes"] if n["op"] == "placeholder")
        node = {"op": "call_function", "name": "payload", "args": [], "kwargs": [], **record}
        node["args"] = [{"node": first} if a == "X" else a for a in node["args"]]
        structure["nodes"].insert(len(structure["nodes"]) - 1, node)
        return json.dumps(document).encode()

    return rewrite


def reseal(root: Path, records: dict[str, FileRecord] | None = None) -> None:
    """The marker an attacker writes: every listed file's real size and SHA-256, plus `records`
    (for a name that is not a regular file inside the folder, which must not be read here)."""
    listed = json.loads((root / "stagewise.json").read_text())["files"]
    files = {n: FileRecord.of_file(root / n) for n in listed if (root / n).is_file() and not (root / n).is_symlink()}
    files.update({n: FileRecord(r["bytes"], r["sha256"]) for n, r in listed.items() if n not in files})
    (root / "stagewise.json").write_text(marker_text({**files, **(records or {})}))


def edit_metadata(root: Path, change: Callable[[Metadata], None]) -> None:
    metadata = pickle.loads((root / METADATA).read_bytes())  # the test's own save: trusted
    change(metadata)
    (root / METADATA).write_bytes(pickle.dumps(metadata))
    reseal(root)


def edit_json(root: Path, name: str, change: Callable[[dict], None]) -> None:
    data = json.loads((root / name).read_text())
    change(data)
    (root / name).write_text(json.dumps(data))
    reseal(root)


def quiet_load(directory: Path, **kwargs) -> sw.Pipeline:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return sw.load(directory, **kwargs)


def refused(entry: str, pipe: sw.Pipeline, directory: Path, capsys: pytest.CaptureFixture) -> str:
    """The CheckpointError's message from reading `directory` through `entry`."""
    if entry == "inspect":
        assert main(["inspect", str(directory)]) == 2
        return capsys.readouterr().err
    with pytest.raises(sw.CheckpointError) as raised:
        if entry == "load":
            quiet_load(directory)
        elif entry == "replan":
            quiet_load(directory, devices=3)
        else:
            pipe.restore(directory)
    return str(raised.value)
