"""Save a pipeline to a directory and load it back without the model class or re-tracing.

Layout: plan.json (the whole IR, programs included), programs.txt (readable), stage_<i>.py
(the stage source that load imports), stage_<i>.pt (the stage's submodules and tensors under
their FQNs, and its optimizer state, all on the CPU), runtime.pt (optimizer factory, clipping,
which stages swap), unused.pt where the model has state no stage holds (a layer the loss never
reaches: kept as it was at compile, so that state_dict and load_state_dict have every key of the
model), stagewise.json (the marker: format version, size and SHA-256 of every other file; load
checks each file it reads against it). Save never replaces anything but a stagewise
checkpoint, and a crash at any moment leaves the old or the new one loadable at the path
(compiler/checkpoint_swap.py).

Under torch.distributed each rank holds only its own stages. Every rank calls `save`; each
snapshots its stages (weights, optimizer state, generated source) to CPU memory and gathers
them to rank 0 (`gather_object`), which writes the whole checkpoint, in the same layout as a
single process, and renames it into place. Every rank returns only after that rename (or raises
the same failure), so no rank reads or overwrites a half-written checkpoint. The files are
written on rank 0's machine: across machines, load from a filesystem every rank shares (or
copy the directory to each machine) to `load` under torchrun; a single process loads it anywhere.
"""

from __future__ import annotations

import io
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import torch
import torch.distributed as dist
import torch.fx as fx

from stagewise.codegen.source import load_stage
from stagewise.compiler.checkpoint_files import MARKER, FileRecord, read_checked, read_marker
from stagewise.compiler.checkpoint_swap import previous_path
from stagewise.compiler.fx_sources import releasing_fx_sources
from stagewise.compiler.pipeline import Pipeline
from stagewise.compiler.runtime_setup import start_runtime
from stagewise.compiler.training_state import TrainingState
from stagewise.ir.errors import CheckpointError, PlanError
from stagewise.ir.plan import Plan
from stagewise.runtime.launch import DistributedContext, distributed_context

_T = TypeVar("_T")


@dataclass(frozen=True)
class _Saved:
    """What a checkpoint holds for this process."""

    plan: Plan
    settings: dict  # runtime.pt: the optimizer factory, clip_grad_norm, the swapped stages
    states: dict[int, dict]  # stage index -> its stage_<i>.pt (attrs, optimizer state), this process's stages
    modules: list[fx.GraphModule | None]  # per stage; another rank's on the meta device
    unheld: dict[str, torch.Tensor]  # unused.pt: state no stage holds


@releasing_fx_sources
def load(directory) -> Pipeline:
    """A Pipeline from `pipe.save(directory)`; trains on from where it was saved.

    In one process it holds every stage. Under torch.distributed (torchrun, one process per
    device of the plan) each rank reads plan.json and only its own stages' files; the ranks
    agree that every one of them could read its part before any starts, so a rank that cannot
    see the directory is an error on every rank, not a hang.
    """
    root = Path(directory)
    context = distributed_context()
    saved = _read(root, None) if context is None else _read_on_every_rank(root, context)
    optimizer, clip = saved.settings["optimizer"], saved.settings["clip_grad_norm"]
    runtime = start_runtime(saved.plan, saved.modules, optimizer, clip, saved.settings.get("swapped", frozenset()))
    for worker in runtime.workers:
        worker.load_optimizer_state(saved.states[worker.stage.index]["optimizer"])
    runtime.executor.iteration = saved.settings.get("step", 0)  # random draws go on where they were saved
    if runtime.executor.scaler is not None and saved.settings.get("loss_scaler") is not None:
        runtime.executor.scaler.load_state_dict(saved.settings["loss_scaler"])  # fp16's scale goes on
    pipe = Pipeline(saved.plan, runtime, unheld=saved.unheld)
    pipe.resumed = TrainingState.from_settings(saved.settings)
    pipe.loss_reduction = saved.settings.get("loss_reduction")  # checked against the loaded plan
    return pipe


def _read_on_every_rank(root: Path, context: DistributedContext) -> _Saved:
    """This rank's part, once every rank could read its own (a rank that cannot fails them all)."""
    try:
        saved = _read(root, context.rank)
        failure = None
    except Exception as error:  # noqa: BLE001 - told to the other ranks, then re-raised
        failure = error
    messages = [None] * context.world_size
    dist.all_gather_object(messages, None if failure is None else f"{type(failure).__name__}: {failure}")
    if failure is not None:
        raise failure
    failed = [f"rank {r}: {m}" for r, m in enumerate(messages) if m is not None]
    if failed:
        raise PlanError(
            f"loading {root} failed on other ranks ({'; '.join(failed)}); every rank must see the "
            "checkpoint directory (across machines: a shared filesystem, or a copy on each)"
        )
    return saved


def _read(root: Path, rank: int | None) -> _Saved:
    """The checkpoint under `root`, every file checked against its marker; under torch.distributed
    the weights and optimizer state only of device `rank`'s stages (the others' code on the meta device)."""
    root = _recovered(root)
    files = read_marker(root)
    plan = _parse(root, "plan.json", files, lambda data: Plan.from_json(data.decode()))
    settings = _parse(root, "runtime.pt", files, _unpickle)
    read_checked(root, "programs.txt", files)  # only for reading, but a damaged copy is still told
    states: dict[int, dict] = {}
    modules: list[fx.GraphModule | None] = []
    for s in plan.stages:
        local = rank is None or s.device == rank
        # another rank's stage: its code on the meta device, for the shapes of a step (compiler/step_shapes.py)
        state = _parse(root, f"stage_{s.index}.pt", files, _unpickle if local else _unpickle_on_meta)
        if local:
            states[s.index] = state
        source = f"stage_{s.index}.py"
        read_checked(root, source, files)
        try:
            modules.append(load_stage(str(root / source), f"Stage{s.index}", state["attrs"]))
        except Exception as error:  # noqa: BLE001 - any failure of a whole file: this stagewise cannot use it
            raise _unusable(root / source, error) from error
    unheld = _parse(root, "unused.pt", files, _unpickle) if "unused.pt" in files else {}
    return _Saved(plan, settings, states, modules, unheld)


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
        stacklevel=4,
    )
    return previous


def _parse(root: Path, name: str, files: dict[str, FileRecord], parse: Callable[[bytes], _T]) -> _T:
    """A checked file of the checkpoint, parsed; a file that is whole but unusable names itself."""
    data = read_checked(root, name, files)
    try:
        return parse(data)
    except Exception as error:  # noqa: BLE001 - any failure of a whole file: this stagewise cannot use it
        raise _unusable(root / name, error) from error


def _unpickle(data: bytes):
    return torch.load(io.BytesIO(data), weights_only=False, map_location="cpu")


def _unpickle_on_meta(data: bytes):
    return torch.load(io.BytesIO(data), weights_only=False, map_location="meta")


def _unusable(path: Path, error: Exception) -> CheckpointError:
    return CheckpointError(
        f"{path} is whole but cannot be used ({type(error).__name__}: {error}); it was probably written by "
        "another version of stagewise or torch: load it with that version"
    )
