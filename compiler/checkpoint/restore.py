"""Putting a checkpoint's state into a running pipeline of any plan of the same model.

Everything in a checkpoint is keyed by the model's names (compiler/checkpoint/state.py), so the
pipeline it goes into may be split differently, on other devices or another number of ranks
(Varuna §4.5, job morphing): each process asks DCP for exactly the names its stages hold and
DCP reads them from whichever shards hold them. `sw.load` goes through here as well, after
rebuilding the saved plan's stages from their structures.
"""

from __future__ import annotations

import torch

from stagewise.compiler.assembly.runtime_setup import Runtime
from stagewise.compiler.assembly.state_dict import aliases_of
from stagewise.compiler.checkpoint.dcp import read_tensors
from stagewise.compiler.checkpoint.read import Checkpoint
from stagewise.compiler.checkpoint.shards import keep_parts, optimizer_parts, whole_buffers
from stagewise.compiler.checkpoint.state import (
    newest_tensors,
    optimizer_tensors,
    stage_constants,
    stage_optimizer_state,
    wanted_tensors,
)
from stagewise.ir.errors import CheckpointError
from stagewise.ir.plan import Plan
from stagewise.runtime.distributed import DistributedTransport


def restore_state(plan: Plan, runtime: Runtime, unheld: dict[str, torch.Tensor], saved: Checkpoint,
                  constants: bool, training_state: bool = True) -> None:
    """Fill this process's weights (and, with `constants`, the stage code's other tensors), the
    state no stage holds and, with `training_state`, the optimizer state, step count and loss
    scale from `saved`; a collective under torch.distributed."""
    _check_same_model(plan, saved.plan, saved)
    shapes = {k: (tuple(v.size), v.properties.dtype) for k, v in saved.tensors.items()}
    read_constants = {w.stage.index: stage_constants(plan, w) for w in runtime.workers} if constants else {}
    wanted, copies = wanted_tensors(plan, runtime.workers, unheld, read_constants)
    parts = whole_buffers(wanted, plan.tensor_parallel)  # a split stage reads whole weights, keeps its part
    newest, unsaved = newest_tensors(plan, runtime.workers, saved.tensors)
    optimizer = {w.stage.index: optimizer_tensors(plan, w, shapes) if training_state else {} for w in runtime.workers}
    group = runtime.transport.checkpoints if isinstance(runtime.transport, DistributedTransport) else None
    # a tied parameter two local stages step: each its own state (and 2bw's newest version), read once
    for key, tensor in [*(pair for part in optimizer.values() for pair in part.items()), *newest]:
        if key in wanted:
            copies.append((key, tensor))
        else:
            wanted[key] = tensor
    with torch.no_grad():
        read_tensors(saved.weights, saved.tensors, wanted, group)
        keep_parts(wanted, parts, plan.tensor_parallel)
        for key, tensor in copies:
            tensor.copy_(wanted[key])
    for worker in unsaved:
        worker.weight_versions.match(worker.params)
    if training_state:
        optimizer = {stage: optimizer_parts(part, plan.tensor_parallel) for stage, part in optimizer.items()}
        _restore_training(plan, runtime, saved.training, optimizer)


def _restore_training(plan: Plan, runtime: Runtime, training: dict, optimizer: dict[int, dict[str, torch.Tensor]]
                      ) -> None:
    """The stages' optimizer states from the tensors read and the saved groups; the step count, the loss scale."""
    for worker in runtime.workers:
        state = stage_optimizer_state(plan, worker, optimizer[worker.stage.index],
                                      training.get("optimizer_values", {}), training.get("optimizer_groups", []))
        worker.load_optimizer_state(state)
    runtime.executor.state.iteration = training.get("step", 0)  # random draws go on where they were saved
    if runtime.executor.state.scaler is not None and training.get("loss_scaler") is not None:
        runtime.executor.state.scaler.load_state_dict(training["loss_scaler"])  # fp16's scale goes on


def unheld_names(plan: Plan) -> list[str]:
    """The model's state_dict keys no stage holds (a layer the loss never reaches)."""
    held = {a for s in plan.stages for n in s.params + s.buffers for a in aliases_of(plan, n)}
    return [n for n in plan.state_names if n not in held]


def _check_same_model(plan: Plan, saved: Plan, checkpoint: Checkpoint) -> None:
    """The checkpoint is of this model: the same state_dict keys (their shapes DCP checks)."""
    if set(plan.state_names) != set(saved.state_names):
        ours, theirs = set(plan.state_names), set(saved.state_names)
        raise CheckpointError(
            f"{checkpoint.root} is a checkpoint of {saved.model} whose state_dict keys differ from this pipeline's "
            f"{plan.model} (only in the checkpoint: {sorted(theirs - ours)[:3]}; only here: {sorted(ours - theirs)[:3]}): "
            "restore a checkpoint of the same model"
        )
