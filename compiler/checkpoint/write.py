"""Writing a checkpoint (the layout: compiler/elastic/load.py; the marker and the checks:
compiler/checkpoint/files.py; how it is put in place safely: compiler/checkpoint/swap.py).

Save refuses a target that holds anything but a stagewise checkpoint, and a crash at any moment
leaves the old or the new checkpoint loadable there. Under torch.distributed rank 0 opens the
staging folder, every rank writes its own stages' tensors into its DCP folder in parallel
(compiler/checkpoint/dcp.py), and rank 0 writes the small files (plan, stage code and structure,
training state) it gathers, then swaps the folder in; every rank returns only after that rename
(or raises the same failure). The staging folder must be one every rank can write: across
machines, a shared filesystem.

A save is two halves (`prepare`): what must happen now (the target checked, the staging folder
opened, this process's state taken, the ranks agreeing that each could) and what may happen on a
thread while training goes on (the tensors written, the small files, the swap). For the latter
(compiler/checkpoint/async_save.py) the state is copied, so later steps cannot change what is written,
and the second half's collectives run over the checkpoints' own gloo group, never the runtime's.
"""

from __future__ import annotations

import copy
import io
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from stagewise.codegen.graph_data import stage_structure, stage_tensors
from stagewise.codegen.source import stage_source
from stagewise.compiler.assembly.optimizer_recipe import optimizer_recipe
from stagewise.compiler.assembly.runtime_setup import Runtime
from stagewise.compiler.checkpoint.dcp import OPTIMIZER_STATE, nested, write_tensors
from stagewise.compiler.checkpoint.files import WEIGHTS_DIR, FileRecord, folder_records
from stagewise.compiler.checkpoint.state import SavedState, merged_groups, saved_state, stage_constants
from stagewise.compiler.checkpoint.swap import abandon, begin, complete, put
from stagewise.ir.errors import CheckpointError, PlanError
from stagewise.ir.plan import Plan
from stagewise.runtime.distributed import DistributedTransport
from stagewise.runtime.worker import StageWorker

GRAPH_FILE = "graph.json"  # the whole graph, to plan again from (compiler/compile/model_graph.py)
MODEL_GRAPH = "model_graph"  # the save's `training` entry holding it (written to GRAPH_FILE, not training.pt)


@dataclass
class _Part:
    """What one process contributes besides its DCP tensors (small: gathered to rank 0)."""

    stages: dict[int, tuple[str, dict]]  # stage index -> (its source, its structure)
    swapped: set[int]
    optimizer: dict | None  # the recipe of its first optimizer
    optimizer_values: dict[str, dict]
    groups: list[dict]


def save(plan: Plan, runtime: Runtime, directory, unheld: dict[str, torch.Tensor], training: dict) -> None:
    """Write the pipeline of `plan`, the state no stage holds (`unheld`, every rank's alike) and the
    training loop's state (`training`: the scheduler's state, user metadata; rank 0's) to
    `directory`, atomically; under torch.distributed every rank must call it."""
    prepare(plan, runtime, directory, unheld, training, snapshot=False)()


def prepare(plan: Plan, runtime: Runtime, directory, unheld: dict[str, torch.Tensor], training: dict,
            snapshot: bool) -> Callable[[], None]:
    """The first half of a save, done now (raising here if it cannot start; under torch.distributed
    every rank must call it); returns the second half, which writes and swaps the checkpoint in.
    With `snapshot` this process's state is copied first, so the second half may run while training
    goes on."""
    target = Path(directory)
    if runtime.context is not None:
        return _prepare_distributed(plan, runtime, target, unheld, training, snapshot)
    state, part = _local_part(plan, runtime.workers, unheld)
    settings = _loop_settings(runtime, training)
    if snapshot:
        state, part, settings = _snapshot(state, runtime.workers, unheld), copy.deepcopy(part), copy.deepcopy(settings)
    staging, replacing = begin(target)

    def finish() -> None:
        try:
            write_tensors(staging / WEIGHTS_DIR, nested(state.split.written(state.tensors)), None)
            complete(staging, target, replacing, _write_small(plan, staging, [part], settings))
        except BaseException:
            abandon(staging)
            raise

    return finish


def _prepare_distributed(plan: Plan, runtime: Runtime, target: Path, unheld: dict[str, torch.Tensor],
                         training: dict, snapshot: bool) -> Callable[[], None]:
    """Rank 0 opens the staging folder, every rank takes its state, and all agree each could; the
    second half: every rank writes its tensors into that folder, rank 0 the rest, and swaps it in."""
    transport = runtime.transport
    if not isinstance(transport, DistributedTransport):
        raise PlanError("saving across ranks needs the torch.distributed transport")
    transport.barrier(
        f"pipe.save({str(target)!r})",
        "under torch.distributed every rank must call pipe.save(directory) (each holds only its own stages), "
        "not only rank 0",
    )
    opened: tuple[Path, bool] | None = None
    failure: BaseException | None = None
    try:
        if transport.rank == 0:
            opened = begin(target)
    except Exception as error:  # noqa: BLE001 - told to the other ranks, then re-raised
        failure = error
    staging_name = transport.from_first(None if opened is None else str(opened[0]))
    try:
        state, part = _local_part(plan, runtime.workers, unheld)
        settings = _loop_settings(runtime, training)
        if snapshot:
            state, part, settings = _snapshot(state, runtime.workers, unheld), copy.deepcopy(part), copy.deepcopy(settings)
    except Exception as error:  # noqa: BLE001 - told to the other ranks, then re-raised
        failure = failure or error
    try:
        _agree(transport, failure, target, "could not start")
    except BaseException:
        if opened is not None:
            abandon(opened[0])
        raise
    assert staging_name is not None
    staging = Path(staging_name)
    return lambda: _finish_distributed(plan, transport, target, staging, opened, state, part, settings)


def _finish_distributed(plan: Plan, transport: DistributedTransport, target: Path, staging: Path,
                        opened: tuple[Path, bool] | None, state: SavedState, part: _Part, settings: dict) -> None:
    """Every rank writes its tensors; rank 0 gathers the rest, writes it and swaps the folder in;
    all raise if any failed. Collectives over the checkpoints' group only (a save's thread may run
    beside steps, which use the runtime's groups)."""
    group = transport.checkpoints
    failure: BaseException | None = None
    try:
        write_tensors(staging / WEIGHTS_DIR, nested(state.split.written(state.tensors)), group)
    except Exception as error:  # noqa: BLE001 - DCP raises on every rank alike
        failure = error
    parts = transport.gather_to_first(part, group)
    outcome = None
    if opened is not None:
        try:
            if failure is None:
                complete(staging, target, opened[1], _write_small(plan, staging, parts or [], settings))
        except Exception as error:  # noqa: BLE001 - told to the other ranks, then re-raised
            failure = error
            outcome = f"rank 0 could not write {target} ({type(error).__name__}: {error})"
        if failure is not None:
            abandon(staging)
    _agree(transport, failure, target, outcome or "failed", group)


def _agree(transport: DistributedTransport, failure: BaseException | None, target: Path, what: str,
           group: dist.ProcessGroup | None = None) -> None:
    """Raise on every rank if any failed: its own error where it has one, else a PlanError naming the
    ranks (agreed over `group`, by default the transport's world)."""
    parts = transport.gather_to_first(None if failure is None else f"{type(failure).__name__}: {failure}", group)
    failed = None if parts is None else [f"rank {r}: {p}" for r, p in enumerate(parts) if p is not None]
    failed = transport.from_first(failed, group)
    if failure is not None:
        raise failure
    if failed:
        raise PlanError(f"pipe.save({str(target)!r}) {what} ({'; '.join(failed)}); any earlier checkpoint there "
                        "is intact")


def _local_part(plan: Plan, workers: list[StageWorker], unheld: dict[str, torch.Tensor]) -> tuple[SavedState, _Part]:
    """This process's tensors (to DCP) and the rest (to rank 0)."""
    stages = {}
    for worker in workers:
        with worker.weights_in_place():  # a swapped stage's parameters are empty on the device
            structure = stage_structure(worker.module)
        stages[worker.stage.index] = (stage_source(worker.module, _stage_doc(plan, worker)), structure)
    state = saved_state(plan, workers, unheld, {w.stage.index: stage_constants(plan, w) for w in workers})
    recipe = next((optimizer_recipe(w.optimizer) for w in workers if w.optimizer is not None), None)
    part = _Part(stages, {w.stage.index for w in workers if w.swapped}, recipe, state.optimizer_values,
                 merged_groups([state.groups], plan))
    return state, part


def _write_small(plan: Plan, staging: Path, parts: list[_Part], loop: dict) -> dict[str, FileRecord]:
    """Everything but the tensors, into `staging` (`loop`: the training loop's state at the save, from
    `_loop_settings`); the records of every file there, DCP's included."""
    files = folder_records(staging, WEIGHTS_DIR)
    files["plan.json"] = put(staging / "plan.json", plan.to_json())
    files["programs.txt"] = put(staging / "programs.txt", "\n\n".join(str(p) for p in plan.programs) + "\n")
    for part in parts:
        for index, (source, structure) in part.stages.items():
            files[f"stage_{index}.py"] = put(staging / f"stage_{index}.py", source)
            files[f"stage_{index}.json"] = put(staging / f"stage_{index}.json", json.dumps(structure, sort_keys=True))
    missing = sorted(s.index for s in plan.stages if f"stage_{s.index}.json" not in files)
    if missing:
        raise PlanError(f"no rank held stages {missing}; the checkpoint would be incomplete")
    loop = dict(loop)
    model_graph = loop.pop(MODEL_GRAPH, None)
    if model_graph is not None:
        files[GRAPH_FILE] = put(staging / GRAPH_FILE, json.dumps(model_graph, sort_keys=True))
    values: dict[str, dict] = {}
    for part in parts:
        for name, entry in part.optimizer_values.items():
            values.setdefault(name, entry)
    settings = {
        **loop, "swapped": sorted(i for part in parts for i in part.swapped),
        "optimizer": next((p.optimizer for p in parts if p.optimizer is not None), None),
        "optimizer_groups": merged_groups([p.groups for p in parts], plan), "optimizer_values": values,
    }
    files["training.pt"] = put(staging / "training.pt", serialised(settings))
    return files


def _loop_settings(runtime: Runtime, training: dict) -> dict:
    """The training loop's state now (`training` and the runtime's step, clipping and loss scale)."""
    scaler = runtime.executor.state.scaler
    return {**training, "step": runtime.executor.state.iteration, "clip_grad_norm": runtime.clip_grad_norm,
            "loss_scaler": None if scaler is None else scaler.state_dict()}


def _snapshot(state: SavedState, workers: list[StageWorker], unheld: dict[str, torch.Tensor]) -> SavedState:
    """`state` with every tensor that shares memory with the live training state copied to the CPU
    (`saved_state` shares a CPU tensor's storage; a device tensor's `.cpu()` is a copy already, not
    copied twice), and the optimizer's tensors (kept live) always."""
    live = {t.untyped_storage().data_ptr() for t in unheld.values()}
    for worker in workers:
        for tensors in (worker.state_tensors(), stage_tensors(worker.module), worker.host, worker.weight_versions.newest,
                        dict(worker.module.named_parameters()), dict(worker.module.named_buffers())):
            live.update(t.untyped_storage().data_ptr() for t in tensors.values() if t.device.type == "cpu")
    copied = {}
    for key, tensor in state.tensors.items():
        shared = tensor.device.type != "cpu" or tensor.untyped_storage().data_ptr() in live
        copied[key] = tensor.detach().to("cpu", copy=True) if shared or key.startswith(OPTIMIZER_STATE + ".") else tensor
    return SavedState(copied, copy.deepcopy(state.optimizer_values), copy.deepcopy(state.groups), state.split)


def serialised(value: object) -> bytes:
    """`value` as torch.save writes it; CheckpointError if `torch.load(weights_only=True)` could not read it back."""
    data = io.BytesIO()
    torch.save(value, data)
    try:
        torch.load(io.BytesIO(data.getvalue()), weights_only=True)
    except Exception as error:  # noqa: BLE001 - any refusal of the safe loader
        raise CheckpointError(f"the checkpoint's training state holds a value that loading without running code "
                              f"cannot read ({error}); give the scheduler and extra= plain values (numbers, "
                              "strings, tensors, lists and dicts of them)") from error
    return data.getvalue()


def _stage_doc(plan: Plan, worker: StageWorker) -> str:
    stage = worker.stage
    layers = [plan.layers[j].name for j in stage.layers]
    return (
        f"Stage {stage.index} of {plan.model}, generated by stagewise (to read: loading never runs it).\n\n"
        f"Layers: {', '.join(layers)}.\nInputs: {', '.join(stage.inputs)}.\n"
        f"Outputs: {', '.join(stage.outputs)}.\n"
    )
