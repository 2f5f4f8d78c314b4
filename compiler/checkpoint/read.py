"""Reading a checkpoint's files, each checked against the marker, without running anything in them.

plan.json and the stage structures are JSON (a key twice in one object refused); training.pt is
read with `torch.load(weights_only=True)`, which builds only tensors and plain containers; the
weights are DCP's, whose metadata `checkpoint_dcp.read_metadata` unpickles with DCP's own classes
only. Every file is opened as a plain name inside the folder, never through a link
(compiler/checkpoint/paths.py), and every size the files declare is checked against the weights
before anything is allocated (compiler/checkpoint/limits.py). Every weights shard is
checked against its SHA-256 before DCP reads any of it, so a damaged shard is an error naming
it, never wrong weights. Under torch.distributed the ranks check a share of the shards each and
agree, so a rank that cannot read the checkpoint is an error on every rank, not a hang.
"""

from __future__ import annotations

import io
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import torch
import torch.distributed as dist

from stagewise.compiler.checkpoint.dcp import METADATA, SavedTensors, read_metadata
from stagewise.compiler.checkpoint.files import (
    MARKER,
    WEIGHTS_DIR,
    FileRecord,
    check_file,
    read_checked,
    read_marker,
)
from stagewise.compiler.checkpoint.limits import check_declared, check_metadata, check_model_graph
from stagewise.compiler.checkpoint.paths import strict_json
from stagewise.compiler.checkpoint.swap import previous_path
from stagewise.compiler.checkpoint.training_file import check_training
from stagewise.compiler.checkpoint.write import GRAPH_FILE
from stagewise.ir.errors import CheckpointError, PlanError
from stagewise.ir.plan import Plan
from stagewise.runtime.launch import DistributedContext

_T = TypeVar("_T")
TRAINING_FILE = "training.pt"


@dataclass(frozen=True)
class Checkpoint:
    """A checkpoint's small files, read and checked; its weights are in `root / WEIGHTS_DIR`."""

    root: Path
    plan: Plan
    training: dict  # training.pt: step, optimizer recipe and groups, scheduler, extra, ...
    structures: list[dict]  # per stage: codegen/graph_data.py's description of its module
    tensors: SavedTensors  # every tensor the weights hold, by flattened key: DCP's metadata, checked
    model_graph: dict | None = None  # graph.json: the whole graph, to plan again (compiler/compile/model_graph.py)

    @property
    def weights(self) -> Path:
        return self.root / WEIGHTS_DIR


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
    """Every small file checked and parsed, every size it declares checked against the weights
    (compiler/checkpoint/limits.py); the weights shards `rank` of `ranks` checks."""
    files = read_marker(root)
    plan = _parse(root, "plan.json", files, lambda data: Plan.from_json(_unique_keys(data, root / "plan.json")))
    training = _parse(root, TRAINING_FILE, files, _safe_load)
    check_training(training, plan, root / TRAINING_FILE)
    read_checked(root, "programs.txt", files)  # only for reading, but a damaged copy is still told
    structures = [_parse(root, f"stage_{s.index}.json", files, _json_object(root / f"stage_{s.index}.json"))
                  for s in plan.stages]
    for stage in plan.stages:
        read_checked(root, f"stage_{stage.index}.py", files)  # the code to read, never run: told when damaged
    shards = sorted(n for n in files if n.startswith(WEIGHTS_DIR + "/"))
    if not shards:
        raise CheckpointError(f"{root / MARKER} lists no weights: {root} is not a complete checkpoint")
    for name in shards[rank::ranks]:
        check_file(root, name, files)
    graph = (_parse(root, GRAPH_FILE, files, lambda data: check_model_graph(strict_json(data, root / GRAPH_FILE)))
             if GRAPH_FILE in files else None)
    tensors = _saved_tensors(root, files)
    for stage, structure in zip(plan.stages, structures, strict=True):
        check_declared(structure, plan, tensors, root / f"stage_{stage.index}.json", plan.tensor_parallel)
    if isinstance(graph, dict) and "graph" in graph:
        check_declared(graph["graph"], plan, tensors, root / GRAPH_FILE)
    return Checkpoint(root, plan, training, structures, tensors, graph)


def _saved_tensors(root: Path, files: dict[str, FileRecord]) -> SavedTensors:
    """The weights' DCP metadata, read whole by every rank and checked against the listed shards."""
    name = f"{WEIGHTS_DIR}/{METADATA}"
    metadata = read_metadata(read_checked(root, name, files), root / name)
    shards = {n.removeprefix(WEIGHTS_DIR + "/"): r.size for n, r in files.items()
              if n.startswith(WEIGHTS_DIR + "/") and n != name}
    return SavedTensors(metadata, check_metadata(metadata, shards, root / name))


def _json_object(path: Path) -> Callable[[bytes], dict]:
    """A parser of `path`'s JSON that must hold one object (a stage structure)."""
    def parse(data: bytes) -> dict:
        parsed = strict_json(data, path)
        if not isinstance(parsed, dict):
            raise CheckpointError(f"a JSON {type(parsed).__name__}, not the object a stage structure is")
        return parsed
    return parse


def _unique_keys(data: bytes, path: Path) -> str:
    """plan.json's text, once it repeats no key in an object (which Plan.from_json would let pass)."""
    strict_json(data, path)
    return data.decode()


def _safe_load(data: bytes) -> dict:
    """training.pt: plain values and tensors only (`weights_only`), none larger than the file."""
    training = torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
    for tensor in _tensors_in(training):
        if tensor.numel() * tensor.element_size() > len(data):
            raise CheckpointError(f"{TRAINING_FILE} holds a tensor of shape {tuple(tensor.shape)}, larger than the file "
                                  "itself: stagewise never writes one; save the pipeline again")
    if not isinstance(training, dict):
        raise CheckpointError(f"{TRAINING_FILE} holds a {type(training).__name__}, not the training state")
    return training


def _tensors_in(value: object) -> Iterator[torch.Tensor]:
    """Every tensor in a nest of dicts, lists and tuples."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors_in(item)
    elif isinstance(value, list | tuple):
        for item in value:
            yield from _tensors_in(item)


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
    except CheckpointError as error:  # a refusal of a check: it says what is wrong and what to do
        raise type(error)(f"{root / name} is whole but cannot be used: {error}") from None
    except Exception as error:  # noqa: BLE001 - any failure of a whole file: this stagewise cannot use it
        raise CheckpointError(
            f"{root / name} is whole but cannot be used ({type(error).__name__}: {error}); it was written by "
            "another version of stagewise or torch, or holds something loading would have to run: load it with "
            "the version that wrote it"
        ) from error
