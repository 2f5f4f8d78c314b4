"""A crafted checkpoint reads nothing outside its folder, follows no link, opens no special file
and allocates no more than its files hold (issue #21, items 1 and 2).

The attacker rewrites any file, the marker included (sizes and SHA-256 are public: `reseal`
writes a marker consistent with the crafted files), so every refusal here comes from the
checks of the names, the file types and the declared sizes, before anything is read or allocated.
Every entry point that reads a checkpoint is covered: sw.load, sw.load on other devices (the
re-plan), pipe.restore and `stagewise inspect`.
"""

from __future__ import annotations

import io
import os
import pickle
import re
import shutil
import zipfile
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata, TensorStorageMetadata

import stagewise as sw
from stagewise.compiler.checkpoint.files import FileRecord
from tests.harness.crafted import (
    ENTRIES,
    METADATA,
    SHARD,
    compiled,
    edit_json,
    edit_metadata,
    refused,
    reseal,
)


@pytest.fixture(scope="module")
def pipe() -> sw.Pipeline:
    return compiled(0)


@pytest.fixture(scope="module")
def saved(pipe, tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("saved") / "ck"
    pipe.save(directory)
    return directory


@pytest.fixture(scope="module")
def other_shard(tmp_path_factory) -> Path:
    """The weights shard of the same model with other values: what an unlisted file would put in."""
    directory = tmp_path_factory.mktemp("other") / "ck"
    compiled(1).save(directory)
    return directory / SHARD


@pytest.fixture
def target(saved, tmp_path) -> Path:
    copy = tmp_path / "ck"
    shutil.copytree(saved, copy)
    return copy


# --- names that leave the folder ----------------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["../../elsewhere.distcp", "ABSOLUTE"])
@pytest.mark.parametrize("entry", ENTRIES)
def test_a_shard_path_in_the_metadata_outside_the_folder_is_refused(pipe, target, other_shard, capsys, path, entry):
    outside = target.parent / "elsewhere.distcp"
    shutil.copy(other_shard, outside)  # the same model's shard with other values: loading it is silent
    relative = str(outside) if path == "ABSOLUTE" else path

    def redirect(metadata: Metadata) -> None:
        for info in metadata.storage_data.values():
            info.relative_path = relative

    edit_metadata(target, redirect)
    message = refused(entry, pipe, target, capsys)
    assert str(target / METADATA) in message and "model." in message and relative in message


def test_a_shard_in_the_folder_that_the_marker_does_not_list_is_not_read(pipe, target, other_shard, capsys):
    shutil.copy(other_shard, target / "weights" / "__1_0.distcp")

    def redirect(metadata: Metadata) -> None:
        for info in metadata.storage_data.values():
            info.relative_path = "__1_0.distcp"

    edit_metadata(target, redirect)
    assert "which the checkpoint's marker does not list" in refused("load", pipe, target, capsys)


@pytest.mark.parametrize(("name", "entry"), [
    *[("weights/../../secret", entry) for entry in ENTRIES],
    *[(name, "load") for name in ["/tmp/secret", "weights/..", "weights//x", "weights\\..\\x", "weights/x\x00y", "",
                                  "weights/ x"]],
])
def test_a_marker_name_outside_the_folder_is_refused_before_opening(pipe, target, capsys, name, entry):
    (target.parent / "secret").write_bytes(b"secret")
    reseal(target, {name: FileRecord.of(b"secret")})
    message = refused(entry, pipe, target, capsys)
    assert str(target / "stagewise.json") in message and repr(name) in message and "not a plain name" in message


# --- links and special files --------------------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "points_to", "entry"), [
    *[(SHARD, "/dev/zero", entry) for entry in ENTRIES],
    *[(name, points_to, "load") for name, points_to in [
        ("plan.json", "COPY"), ("training.pt", "/dev/zero"), ("weights", "COPY"), (METADATA, "COPY")]],
])
def test_a_symbolic_link_in_the_checkpoint_is_refused(pipe, target, capsys, name, points_to, entry):
    path = target / name
    if points_to == "COPY":  # the very same bytes, elsewhere: only the link is wrong
        points_to = str(target.parent / "copy")
        os.rename(path, points_to)
    else:
        path.unlink()
    os.symlink(points_to, path)
    message = refused(entry, pipe, target, capsys)
    assert str(path) in message and "symbolic link" in message


@pytest.mark.parametrize("entry", ENTRIES)
def test_the_checkpoint_folder_itself_a_link_is_refused(pipe, target, capsys, entry):
    link = target.parent / "link"
    os.symlink(target, link)
    assert "symbolic link" in refused(entry, pipe, link, capsys)


@pytest.mark.parametrize(("name", "entry"), [*[(SHARD, entry) for entry in ENTRIES], ("training.pt", "load")])
def test_a_fifo_is_refused_without_opening_it_for_reading(pipe, target, capsys, name, entry):
    """Opening a FIFO to read blocks until a writer comes: the file type is checked first, so it never hangs."""
    (target / name).unlink()
    os.mkfifo(target / name)
    message = refused(entry, pipe, target, capsys)
    assert str(target / name) in message and "FIFO" in message


# --- sizes declared beyond the files ------------------------------------------------------------------------------


def huge_linear(structure: dict) -> None:
    """stage_0's first Linear as Linear(100000, 200000): 80 GB of float32 if it were materialized."""
    structure["modules"]["0"]["arguments"].update(in_features=100_000, out_features=200_000)
    structure["tensors"]["0.weight"]["shape"] = [200_000, 100_000]
    structure["tensors"]["0.bias"]["shape"] = [200_000]


@pytest.mark.parametrize("entry", ENTRIES)
def test_a_skeleton_declaring_a_huge_module_is_refused_before_allocating(pipe, target, capsys, entry):
    edit_json(target, "stage_0.json", huge_linear)
    message = refused(entry, pipe, target, capsys)
    assert str(target / "stage_0.json") in message and re.search(r"tensor 0\.(weight|bias) as \(200000", message)


def test_a_huge_module_declared_in_the_metadata_as_well_is_refused(pipe, target, capsys):
    """The metadata agrees with the skeleton, but its bytes cannot be in the shard."""
    edit_json(target, "stage_0.json", huge_linear)

    def enlarge(metadata: Metadata) -> None:
        entry = metadata.state_dict_metadata["model.0.weight"]
        entry.size = torch.Size([200_000, 100_000])
        entry.chunks = [ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([200_000, 100_000]))]

    edit_metadata(target, enlarge)
    message = refused("load", pipe, target, capsys)
    assert str(target / METADATA) in message and "'model.0.weight'" in message and "too small a byte range" in message


def test_graph_json_declaring_a_huge_tensor_is_refused(pipe, target, capsys):
    edit_json(target, "graph.json", lambda graph: huge_linear(graph["graph"]))
    message = refused("replan", pipe, target, capsys)
    assert str(target / "graph.json") in message and re.search(r"tensor 0\.(weight|bias) as \(200000", message)


def test_a_skeleton_argument_beyond_its_tensors_is_refused_before_construction(pipe, target, capsys):
    edit_json(target, "stage_0.json", lambda s: s["modules"]["2"]["arguments"].update(in_features=10 ** 15))
    message = refused("load", pipe, target, capsys)
    assert str(target / "stage_0.json") in message and "leaf module 2:" in message
    assert "in_features=1000000000000000" in message


@pytest.mark.parametrize("shape", [[-1, 8], [2 ** 40, 2 ** 40], [16.0, 8], "16x8", [1] * 65])
def test_an_impossible_declared_shape_is_refused(pipe, target, capsys, shape):
    edit_json(target, "stage_0.json", lambda s: s["tensors"]["0.weight"].update(shape=shape))
    message = refused("load", pipe, target, capsys)
    assert str(target / "stage_0.json") in message and "0.weight" in message


def test_a_declared_dtype_other_than_the_saved_one_is_refused(pipe, target, capsys):
    edit_json(target, "stage_0.json", lambda s: s["tensors"]["0.weight"].update(dtype="float64"))
    assert "torch.float64" in refused("load", pipe, target, capsys)


def overlap_two_tensors(metadata: Metadata) -> None:
    """model.0.bias read from model.0.weight's bytes: two tensors, one byte range."""
    infos = {index.fqn: info for index, info in metadata.storage_data.items()}
    infos["model.0.bias"].offset = infos["model.0.weight"].offset


def chunk_twice(metadata: Metadata) -> None:
    entry = metadata.state_dict_metadata["model.0.bias"]
    entry.chunks = [entry.chunks[0], entry.chunks[0]]


def beyond_the_shard(metadata: Metadata) -> None:
    for info in metadata.storage_data.values():
        info.offset += 1 << 40


def bytes_entry(metadata: Metadata) -> None:
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    metadata.state_dict_metadata["model.extra"] = BytesStorageMetadata()


def transformed(metadata: Metadata) -> None:
    for info in metadata.storage_data.values():
        info.transform_descriptors = ["zstd"]


def negative_size(metadata: Metadata) -> None:
    entry: TensorStorageMetadata = metadata.state_dict_metadata["model.0.bias"]
    entry.size = torch.Size([-16])


@pytest.mark.parametrize(("change", "message"), [
    (overlap_two_tensors, "already hold"), (chunk_twice, "saves parts of 'model.0.bias' twice"),
    (beyond_the_shard, "which holds"), (bytes_entry, "'model.extra' as a BytesStorageMetadata"),
    (transformed, "transformed"), (negative_size, "'model.0.bias'"),
])
def test_crafted_dcp_metadata_is_refused(pipe, target, capsys, change, message):
    edit_metadata(target, change)
    got = refused("load", pipe, target, capsys)
    assert str(target / METADATA) in got and message in got


# --- duplicate keys, training.pt ----------------------------------------------------------------------------------


def test_a_key_twice_in_a_stage_structure_is_refused(pipe, target, capsys):
    text = (target / "stage_0.json").read_text().rstrip()
    (target / "stage_0.json").write_text(text[:-1] + ', "training": false}')  # json.loads keeps the last silently
    reseal(target)
    message = refused("load", pipe, target, capsys)
    assert str(target / "stage_0.json") in message and "'training' twice" in message


@pytest.mark.parametrize("entry", ["load", "restore", "inspect"])
def test_a_stage_structure_that_is_not_an_object_is_refused(pipe, target, capsys, entry):
    (target / "stage_0.json").write_text('["op", "call_function"]')  # was a TypeError deep in the build
    reseal(target)
    message = refused(entry, pipe, target, capsys)
    assert "stage_0.json" in message and "a JSON list, not the object a stage structure is" in message


def test_a_marker_that_is_not_an_object_is_refused(pipe, target, capsys):
    (target / "stagewise.json").write_text("[1, 2]")
    message = refused("load", pipe, target, capsys)
    assert "stagewise.json is corrupted" in message and "a JSON list, not an object" in message


def test_a_file_twice_in_the_marker_is_refused(pipe, target, capsys):
    marker = target / "stagewise.json"
    text = marker.read_text()
    entry = re.search(r'"plan.json": \{[^}]*\}', text)
    assert entry is not None
    marker.write_text(text.replace(entry.group(0), f"{entry.group(0)}, {entry.group(0)}", 1))
    assert "'plan.json' twice" in refused("load", pipe, target, capsys)


class Payload:
    def __reduce__(self):
        return (os.system, ("touch ran",))


def storage_of_a_class() -> bytes:
    """torch.save's archive of a tensor whose storage type names a function that is no storage."""
    buffer, out = io.BytesIO(), io.BytesIO()
    torch.save({"step": torch.zeros(2)}, buffer)
    with zipfile.ZipFile(buffer) as archive, zipfile.ZipFile(out, "w") as crafted:
        for name in archive.namelist():
            data = archive.read(name)
            crafted.writestr(name, data.replace(b"ctorch\nFloatStorage\n", b"cos\nsystem\n"))
    assert b"cos\nsystem" in zipfile.ZipFile(out).read("archive/data.pkl")
    return out.getvalue()


def expanded() -> bytes:
    buffer = io.BytesIO()
    torch.save({"step": 3, "extra": torch.zeros(1).expand(10 ** 12)}, buffer)  # one float's storage
    return buffer.getvalue()


@pytest.mark.parametrize("crafted", ["reduce", "storage-class", "expanded"])
def test_training_pt_holds_only_plain_values_and_tensors_no_larger_than_itself(pipe, target, capsys, crafted,
                                                                             monkeypatch):
    monkeypatch.chdir(target.parent)
    data = {"reduce": lambda: pickle.dumps({"step": Payload()}), "storage-class": storage_of_a_class,
            "expanded": expanded}[crafted]()
    (target / "training.pt").write_bytes(data)
    reseal(target)
    message = refused("load", pipe, target, capsys)
    assert str(target / "training.pt") in message
    assert not (target.parent / "ran").exists()

