"""Reading a checkpoint's files, each checked against the marker, without running anything in them.

plan.json and the stage structures are JSON; training.pt is read with `torch.load(weights_only=
True)`, which builds only tensors and plain containers; the weights are DCP's, whose metadata
`checkpoint_dcp.SafeReader` unpickles with DCP's own classes only. Every weights shard is
checked against its SHA-256 before DCP reads any of it, so a damaged shard is an error naming
it, never wrong weights. Under torch.distributed the ranks check a share of the shards each and
agree, so a rank that cannot read the checkpoint is an error on every rank, not a hang.
"""

from __future__ import annotations

import functools
import io
import json
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from stagewise.compiler.checkpoint_dcp import saved_tensors
from stagewise.compiler.checkpoint_files import (
    MARKER,
    WEIGHTS_DIR,
    FileRecord,
    check_file,
    read_checked,
    read_marker,
)
from stagewise.compiler.checkpoint_swap import previous_path
from stagewise.compiler.checkpoint_write import GRAPH_FILE
from stagewise.ir.errors import CheckpointError, PlanError
from stagewise.ir.plan import Plan
from stagewise.runtime.launch import DistributedContext

_T = TypeVar("_T")


@dataclass(frozen=True)
class Checkpoint:
    """A checkpoint's small files, read and checked; its weights are in `root / WEIGHTS_DIR`."""

    root: Path
    plan: Plan
    training: dict  # training.pt: step, optimizer recipe and groups, scheduler, extra, ...
    structures: list[dict]  # per stage: codegen/graph_data.py's description of its module
    model_graph: dict | None = None  # graph.json: the whole graph, to plan again (compiler/model_graph.py)

    @property
    def weights(self) -> Path:
        return self.root / WEIGHTS_DIR

    @functools.cached_property
    def tensors(self) -> dict[str, TensorStorageMetadata]:
        """Every tensor the weights hold, by flattened key: DCP's metadata, read once."""
        return saved_tensors(self.weights)


def trusted_by_name(functions: Sequence[Callable]) -> dict[str, Callable]:
    """The caller's `trusted_functions` under the names a checkpoint's graphs call them by."""
    return {f"{f.__module__}.{f.__qualname__}": f for f in functions}


def read_checkpoint(directory, context: DistributedContext | None) -> Checkpoint:
    """The checkpoint at `directory` (or the previous one an interrupted save left beside it)."""
    root = _recovered(Path(directory))
    if context is None:
        return _read(root, 0, 1)
    try:
        saved, failure = _read(root, context.rank, context.world_size), None
    except Exception as error:  # noqa: BLE001 - told to the other ranks, then re-raised
        saved, failure = None, error
    messages: list = [None] * context.world_size
    dist.all_gather_object(messages, None if failure is None else f"{type(failure).__name__}: {failure}")
    if failure is not None:
        raise failure
    failed = [f"rank {r}: {m}" for r, m in enumerate(messages) if m is not None]
    if failed:
        raise PlanError(f"loading {root} failed on other ranks ({'; '.join(failed)}); every rank must see the "
                        "checkpoint directory (across machines: a shared filesystem, or a copy on each)")
    assert saved is not None
    return saved


def _read(root: Path, rank: int, ranks: int) -> Checkpoint:
    """Every small file checked and parsed; the weights shards `rank` of `ranks` checks."""
    files = read_marker(root)
    plan = _parse(root, "plan.json", files, lambda data: Plan.from_json(data.decode()))
    training = _parse(root, "training.pt", files, _safe_load)
    read_checked(root, "programs.txt", files)  # only for reading, but a damaged copy is still told
    structures = [_parse(root, f"stage_{s.index}.json", files, json.loads) for s in plan.stages]
    for stage in plan.stages:
        read_checked(root, f"stage_{stage.index}.py", files)  # the code to read, never run: told when damaged
    shards = sorted(n for n in files if n.startswith(WEIGHTS_DIR + "/"))
    if not shards:
        raise CheckpointError(f"{root / MARKER} lists no weights: {root} is not a complete checkpoint")
    for name in shards[rank::ranks]:
        check_file(root, name, files)
    graph = _parse(root, GRAPH_FILE, files, json.loads) if GRAPH_FILE in files else None
    return Checkpoint(root, plan, training, structures, graph)


def _safe_load(data: bytes) -> dict:
    return torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")


def _recovered(root: Path) -> Path:
    """`root`, or, where a save was interrupted between its two renames, the previous checkpoint it
    left complete beside it (said in a warning)."""
    previous = previous_path(root)
    if root.exists() or not (previous / MARKER).is_file():
        return root
    warnings.warn(
        f"{root} is missing: a save to it was interrupted while replacing the checkpoint there; loading "
        f"the previous checkpoint from {previous} (the next pipe.save({str(root)!r}) puts one back at "
        f"{root}, or rename {previous.name} to {root.name})",
        stacklevel=5,
    )
    return previous


def _parse(root: Path, name: str, files: dict[str, FileRecord], parse: Callable[[bytes], _T]) -> _T:
    """A checked file of the checkpoint, parsed; a file that is whole but unusable names itself."""
    data = read_checked(root, name, files)
    try:
        return parse(data)
    except Exception as error:  # noqa: BLE001 - any failure of a whole file: this stagewise cannot use it
        raise CheckpointError(
            f"{root / name} is whole but cannot be used ({type(error).__name__}: {error}); it was written by "
            "another version of stagewise or torch, or holds something loading would have to run: load it with "
            "the version that wrote it"
        ) from error
