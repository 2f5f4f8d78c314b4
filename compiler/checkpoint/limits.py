"""The sizes a checkpoint declares, checked against its files before anything is allocated.

A crafted checkpoint can declare any shape (a stage structure's `Linear(100000, 200000)`, a
DCP entry of 80 GB): loading allocates what the structures and DCP's metadata declare before DCP
reads a byte. So DCP's metadata is checked first: each tensor's chunks tile it exactly, each
chunk's bytes lie in a byte range of a shard the marker lists (numel × element size within
the range's length, the range within the shard's size), and no two ranges overlap, so all the
tensors together are no larger than the shards on disk. Then every tensor a stage structure
declares must be a saved one of that shape and dtype. Each refusal names the file and the entry.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)

from stagewise.codegen.graph_data import FORMAT as STRUCTURE_FORMAT
from stagewise.codegen.stage_tensors import declared_tensor
from stagewise.compiler.assembly.state_dict import aliases_of
from stagewise.compiler.checkpoint.dcp import CONSTANTS, MODEL
from stagewise.compiler.checkpoint.paths import plain_name
from stagewise.ir.declared import plain_shape
from stagewise.ir.errors import CheckpointError
from stagewise.ir.plan import Plan
from stagewise.ir.tensor_parallel import TensorParallel

_MAX_CHUNKS = 4096  # per tensor: one per rank that wrote a part of it
_CRAFTED = "stagewise never writes this: the checkpoint was altered; save the pipeline again"


def check_metadata(metadata: Metadata, shards: Mapping[str, int], path: Path) -> dict[str, TensorStorageMetadata]:
    """Every tensor of DCP's `metadata` (read from `path`), once its bytes fit in the listed
    `shards` (name within weights/ -> size) and no bytes are claimed twice (module docstring)."""
    storage = metadata.storage_data
    entries = metadata.state_dict_metadata
    if not isinstance(storage, dict) or not isinstance(entries, dict):
        raise CheckpointError(f"{path} has no table of tensors and their files; {_CRAFTED}")
    ranges: dict[str, list[tuple[int, int, str]]] = {}
    for index, info in storage.items():
        name = _check_range(index, info, shards, path)
        ranges.setdefault(name, []).append((info.offset, info.offset + info.length, index.fqn))
    for name, spans in ranges.items():
        spans.sort()
        for (_, end, first), (start, _, second) in zip(spans, spans[1:], strict=False):
            if start < end:
                raise CheckpointError(f"{path} puts {second!r} in bytes of weights/{name} that already hold "
                                      f"{first!r}; {_CRAFTED}")
    tensors = {}
    for key, entry in entries.items():
        if not (isinstance(key, str) and isinstance(entry, TensorStorageMetadata)):
            raise CheckpointError(f"{path} holds {key!r} as a {type(entry).__name__}, not a tensor (DCP reads other "
                                  f"entries with an unrestricted pickle); {_CRAFTED}")
        _check_chunks(key, entry, storage, path)
        tensors[key] = entry
    return tensors


def _check_range(index: object, info: object, shards: Mapping[str, int], path: Path) -> str:
    """The listed shard a storage entry's bytes lie in (within its size, no transforms)."""
    if not (isinstance(index, MetadataIndex) and isinstance(index.fqn, str) and isinstance(info, _StorageInfo)):
        raise CheckpointError(f"{path} holds the storage entry {index!r}: {info!r}; {_CRAFTED}")
    name = plain_name(info.relative_path, f"{path} (entry {index.fqn!r})")
    if "/" in name or name not in shards:
        raise CheckpointError(f"{path} reads {index.fqn!r} from weights/{name}, which the checkpoint's marker does not "
                              f"list as a weights shard; stagewise reads only listed, checked files; {_CRAFTED}")
    if info.transform_descriptors:
        raise CheckpointError(f"{path} stores {index.fqn!r} transformed ({info.transform_descriptors}); {_CRAFTED}")
    offset, length = info.offset, info.length
    if not (type(offset) is int and type(length) is int and 0 <= offset and 0 <= length
            and offset + length <= shards[name]):
        raise CheckpointError(f"{path} puts {index.fqn!r} at bytes {offset!r}+{length!r} of weights/{name}, which "
                              f"holds {shards[name]} bytes; {_CRAFTED}")
    return name


def _check_chunks(key: str, entry: TensorStorageMetadata, storage: dict, path: Path) -> None:
    """The tensor's chunks tile its shape exactly, each in a storage range large enough for its bytes."""
    size = checked_shape(entry.size, f"{path} (entry {key!r})")
    dtype = getattr(entry.properties, "dtype", None)
    chunks = entry.chunks
    if not isinstance(dtype, torch.dtype) or not isinstance(chunks, list) or len(chunks) > _MAX_CHUNKS:
        raise CheckpointError(f"{path} describes {key!r} with dtype {dtype!r} and chunks {str(chunks)[:80]}; {_CRAFTED}")
    boxes = []
    for chunk in chunks:
        where = f"{path} (entry {key!r}, chunk {chunk!r})"
        if not isinstance(chunk, ChunkStorageMetadata):
            raise CheckpointError(f"{where} is not a chunk; {_CRAFTED}")
        offsets, sizes = checked_shape(chunk.offsets, where), checked_shape(chunk.sizes, where)
        if len(offsets) != len(size) or len(sizes) != len(size) or any(
                o + s > d for o, s, d in zip(offsets, sizes, size, strict=True)):
            raise CheckpointError(f"{where} lies outside the tensor's shape {size}; {_CRAFTED}")
        info = storage.get(MetadataIndex(key, offsets))
        if info is None or math.prod(sizes) * dtype.itemsize > info.length:
            raise CheckpointError(f"{where} has {'no' if info is None else 'too small a'} byte range in the weights "
                                  f"shards for its {math.prod(sizes)} {dtype} elements; {_CRAFTED}")
        boxes.append((offsets, sizes))
    _check_tiling(key, size, [b for b in boxes if math.prod(b[1])], path)


def _check_tiling(key: str, size: tuple[int, ...], boxes: list[tuple[tuple[int, ...], ...]], path: Path) -> None:
    """Non-empty chunks that do not overlap and together hold every element: the tensor is read whole."""
    for i, (first, first_sizes) in enumerate(boxes):
        for second, second_sizes in boxes[i + 1:]:
            if all(a < b + m and b < a + n for a, n, b, m in zip(first, first_sizes, second, second_sizes, strict=True)):
                raise CheckpointError(f"{path} saves parts of {key!r} twice (chunks at {first} and {second}); "
                                      f"{_CRAFTED}")
    if sum(math.prod(s) for _, s in boxes) != math.prod(size):
        raise CheckpointError(f"{path} saves only part of {key!r} (its chunks do not cover its shape {size}); "
                              f"{_CRAFTED}")


def checked_shape(value: object, where: object) -> tuple[int, ...]:
    """`value` as a shape (ir/declared.py's plain_shape), else a CheckpointError naming `where`."""
    shape = plain_shape(value)
    if shape is None:
        raise CheckpointError(f"{where} declares the shape {str(value)[:200]}, which no tensor has; {_CRAFTED}")
    return shape


def check_declared(structure: object, plan: Plan, saved: Mapping[str, TensorStorageMetadata], where: Path,
                   split: TensorParallel | None = None) -> None:
    """Every tensor a stage structure (or graph.json's graph) declares is a saved one of its shape
    and dtype (a tie is its owner's), so building the stage allocates no more than the shards hold;
    a stage `split` over ranks declares one rank's part of each split tensor. A structure of another
    format is left to `build_stage`, which refuses it before allocating."""
    if not (isinstance(structure, dict) and structure.get("format") == STRUCTURE_FORMAT):
        return
    records = structure.get("tensors")
    if not isinstance(records, dict):
        raise CheckpointError(f"{where} declares no table of tensors; {_CRAFTED}")
    state_names = set(plan.state_names)
    for fqn, record in records.items():
        if isinstance(record, dict) and "alias_of" in record:
            continue
        try:
            shape, dtype = declared_tensor(str(fqn), record)
        except CheckpointError as error:
            raise CheckpointError(f"{where}: {error}; {_CRAFTED}") from None
        held = [a for a in aliases_of(plan, str(fqn)) if a in state_names]
        key = f"{MODEL}.{held[0]}" if held else f"{CONSTANTS}.{fqn}"
        entry = saved.get(key)
        expected = None if entry is None else _part_shape(tuple(entry.size), held[0] if held else None, split)
        if entry is None or expected != shape or entry.properties.dtype != dtype:
            got = "nothing" if entry is None else f"{expected} {entry.properties.dtype}"
            raise CheckpointError(f"{where} declares the tensor {fqn} as {shape} {dtype}, but the weights hold {got} "
                                  f"under {key!r}; {_CRAFTED}")


def _part_shape(whole: tuple[int, ...], name: str | None, split: TensorParallel | None) -> tuple[int, ...] | None:
    """The shape a stage holds of a saved tensor: `whole`, or one rank's part of a split one (None: it
    does not split as plan.json says)."""
    parameter = None if split is None or name is None else split.sharded().get(name)
    return whole if parameter is None or split is None else parameter.part_shape(whole, split.degree)


def check_model_graph(model_graph: object) -> dict:
    """graph.json's content once it is a table whose options are a table: what `sw.load` reads of
    it before any check of its graph (whether to plan again, the saved options)."""
    if not isinstance(model_graph, dict):
        raise CheckpointError(f"it holds a {type(model_graph).__name__}, not a table; {_CRAFTED}")
    options = model_graph.get("options", {})
    if not isinstance(options, dict):
        raise CheckpointError(f"its 'options' are {repr(options)[:80]}, not a table; {_CRAFTED}")
    return model_graph
