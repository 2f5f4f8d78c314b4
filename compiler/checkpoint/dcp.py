"""A checkpoint's tensors in torch.distributed.checkpoint (DCP), the ecosystem's format.

The folder `weights/` of a checkpoint is a DCP checkpoint of a nested dict: `model` holds the
original model's `state_dict()` under its own names (so plain PyTorch reads it into the model
with `dcp.load({"model": model.state_dict()}, checkpoint_id=...)`), `optimizer.state` every
parameter's optimizer tensors keyed by that parameter's name (as torch's
`get_optimizer_state_dict` does), `constants` the tensors the stage code reads that are not in
`state_dict()` (non-persistent buffers, constants torch.export lifted), and under schedule="2bw"
`newest` the newer of the two versions of each trained weight (`model` holds the one the next step
computes with). Only tensors: DCP reads non-tensor entries with an unrestricted pickle, so those go
in the checkpoint's `training.pt`.

Under torch.distributed every rank writes its own stages' tensors into one DCP checkpoint in
parallel (DCP's coordinator writes its `.metadata`; a tensor two ranks hold is written once).
Loading reads, on each rank, only the keys its stages hold (Varuna §4.2, per-layer checkpoints),
whatever plan saved them. DCP reads `.metadata` with `pickle.load`: stagewise reads it itself
(`read_metadata`), with an unpickler that builds only DCP's metadata classes, so a checkpoint
cannot run code on load, and hands it to DCP checked (`SafeReader`).
"""

from __future__ import annotations

import io
import os
import pathlib
import pickle
import warnings
from collections.abc import Generator, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata

from stagewise.compiler.checkpoint.paths import open_file
from stagewise.ir.errors import CheckpointError

MODEL, OPTIMIZER_STATE, CONSTANTS = "model", "optimizer.state", "constants"
NEWEST = "newest"  # 2bw's second weight version, by the model's names (runtime/weight_versions.py)
METADATA = ".metadata"
_METADATA_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem")
_PATHS = {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"}


class _MetadataUnpickler(pickle.Unpickler):
    """Builds DCP's metadata dataclasses, torch dtypes, sizes and paths, nothing else."""

    def find_class(self, module: str, name: str):  # noqa: ANN201 - pickle's signature
        if module in _METADATA_MODULES and not name.startswith("__"):
            found = getattr(__import__(module, fromlist=[name]), name, None)
            if isinstance(found, type):
                return found
        found = vars(torch).get(name)  # what torch holds, never its __getattr__ (which imports lazy submodules)
        if module == "torch" and (name == "Size" or isinstance(found, torch.dtype | torch.layout | torch.memory_format)):
            return found
        if (module, name) == ("torch.serialization", "_get_layout"):
            return torch.serialization._get_layout
        if module == "pathlib" and name in _PATHS:
            return getattr(pathlib, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a DCP checkpoint's metadata")


def read_metadata(data: bytes, path: Path) -> Metadata:
    """DCP's metadata from the bytes of `path`, unpickled with only DCP's own classes (CheckpointError if not)."""
    try:
        metadata = _MetadataUnpickler(io.BytesIO(data)).load()
    except (pickle.UnpicklingError, EOFError, AttributeError, TypeError, ValueError, IndexError, KeyError) as error:
        raise CheckpointError(f"{path} is not the metadata of a torch.distributed.checkpoint ({error}); stagewise "
                              "refuses to load it, as reading it could run code") from error
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"{path} holds a {type(metadata).__name__}, not DCP metadata")
    return metadata


class SavedTensors(Mapping[str, TensorStorageMetadata]):
    """Every tensor a DCP checkpoint holds, by flattened key (`model.<name>`, ...), with the
    metadata they were found in, checked (compiler/checkpoint/limits.py): DCP reads by it."""

    def __init__(self, metadata: Metadata, tensors: dict[str, TensorStorageMetadata]):
        self.metadata = metadata
        self._tensors = tensors

    def __getitem__(self, key: str) -> TensorStorageMetadata:
        return self._tensors[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)


class _NoLinks(FileSystem):
    """DCP's file access for reading, opening only regular files and through no link
    (checkpoint_paths.open_file), so a shard swapped for a link or a FIFO after its check is refused."""

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Generator[io.IOBase, None, None]:
        if mode != "rb":
            raise CheckpointError(f"stagewise reads a checkpoint only, but DCP asked to open {path} with {mode!r}")
        where = Path(path)
        with open_file(where.parent, where.name) as fd, os.fdopen(os.dup(fd), "rb") as stream:
            yield stream


class SafeReader(dcp.FileSystemReader):
    """DCP's file reader, given the metadata stagewise read and checked: DCP never unpickles the
    file itself, and reads only the shards that metadata names (each one the marker lists)."""

    def __init__(self, folder: Path, saved: SavedTensors):
        super().__init__(str(folder))
        self.fs = _NoLinks()
        self.saved = saved

    def read_metadata(self, *args, **kwargs) -> Metadata:  # noqa: ANN002, ANN003 - torch's signature varies
        metadata = self.saved.metadata
        storage = getattr(metadata, "storage_meta", None) or StorageMeta()
        storage.load_id = self.load_id
        metadata.storage_meta = storage
        return metadata


@contextmanager
def _single_process_intended():
    """DCP's no_dist save and load warn "torch.distributed is disabled ... assuming the intent is to save
    in a single process" every time: that is the intent here, so that warning alone is not shown. Not
    `warnings.catch_warnings`, which swaps the whole filter list and puts it back (an asynchronous save
    runs this on its own thread: what the main thread filtered meanwhile would be lost): the one filter
    is added, and that same one removed."""
    warnings.filterwarnings("ignore", "torch.distributed is disabled, unavailable or uninitialized", UserWarning)
    added = warnings.filters[0]
    try:
        yield
    finally:
        position = next((i for i, entry in enumerate(warnings.filters) if entry is added), None)
        if position is not None:
            del warnings.filters[position]


def write_tensors(folder: Path, tensors: Mapping[str, Mapping], group: dist.ProcessGroup | None) -> None:
    """Write this process's part of the nested `tensors` dict into `folder` (a collective over
    `group` under torch.distributed: every rank calls it, with the keys it holds)."""
    writer = dcp.FileSystemWriter(str(folder), sync_files=True)
    if group is None:
        with _single_process_intended():
            dcp.save(dict(tensors), storage_writer=writer, no_dist=True)
    else:
        dcp.save(dict(tensors), storage_writer=writer, process_group=group)


def read_tensors(folder: Path, saved: SavedTensors, wanted: Mapping[str, torch.Tensor],
                 group: dist.ProcessGroup | None) -> None:
    """Fill `wanted` (flattened key -> tensor of the saved shape) in place from `folder`, whose
    tensors `saved` lists; every key must be saved with that shape (CheckpointError naming the
    first that is not)."""
    for key, tensor in wanted.items():
        if key not in saved:
            raise CheckpointError(f"{folder} holds no {key!r}: the checkpoint is not of this model (or lacks that "
                                  "state); load it into the model it was saved from")
        if tuple(saved[key].size) != tuple(tensor.shape):
            raise CheckpointError(f"{folder} holds {key!r} of shape {tuple(saved[key].size)}, but this pipeline's is "
                                  f"{tuple(tensor.shape)}: the checkpoint is of another model configuration")
    sections = nested(wanted)
    reader = SafeReader(folder, saved)
    if group is None:
        with _single_process_intended():
            dcp.load(sections, storage_reader=reader, no_dist=True)
    else:
        dcp.load(sections, storage_reader=reader, process_group=group)


def nested(flat: Mapping[str, torch.Tensor]) -> dict:
    """{'model.a.b': t} as {'model': {'a.b': t}}: DCP flattens one level of our dicts per section."""
    sections: dict[str, dict] = {}
    for key, tensor in flat.items():
        section = next(s for s in (OPTIMIZER_STATE, MODEL, CONSTANTS, NEWEST) if key.startswith(s + "."))
        rest = key[len(section) + 1:]
        if section == OPTIMIZER_STATE:
            name, state_key = rest.rsplit(".", 1)
            sections.setdefault("optimizer", {}).setdefault("state", {}).setdefault(name, {})[state_key] = tensor
        else:
            sections.setdefault(section, {})[rest] = tensor
    return sections
