"""`pipe.restore`: a checkpoint into a pipeline of the same model on other devices, and what moved.

Varuna (§4.5) morphs a job to the machines it has now: the checkpoint is per layer, so a new
P x D configuration reads the layers its stages hold, wherever they were. Here every device's
stages read their names' weights and optimizer state from the checkpoint
(compiler/checkpoint/restore.py). `Move` tells the user what changed: the devices and the
layers on each, before and after, the predicted iteration times of both plans, and the bytes
each device reads that the device of the same index did not hold before (what re-sharding moves).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING

from stagewise.compiler.assembly.optimizer_recipe import check_same_optimizer
from stagewise.compiler.assembly.state_dict import aliases_of
from stagewise.compiler.checkpoint.dcp import MODEL, OPTIMIZER_STATE
from stagewise.compiler.checkpoint.read import Checkpoint, read_checkpoint
from stagewise.compiler.checkpoint.restore import restore_state
from stagewise.compiler.pipeline.training_state import TrainingState
from stagewise.ir.devices import format_bytes
from stagewise.ir.plan import Plan

if TYPE_CHECKING:
    from pathlib import Path

    from stagewise.compiler.pipeline.pipeline import Pipeline


@dataclass(frozen=True)
class Move:
    """What restoring a checkpoint into another plan changed."""

    before: Plan
    after: Plan
    read_bytes: tuple[int, ...]  # per device of `after`: the saved state its stages read
    moved_bytes: tuple[int, ...]  # of that, what the device of the same index did not hold before

    @property
    def changed(self) -> bool:
        return _layout(self.before) != _layout(self.after)

    def __str__(self) -> str:
        lines = [f"restored a checkpoint of {len(self.before.devices)} device(s) onto {len(self.after.devices)}:"]
        for label, plan in (("before", self.before), ("after", self.after)):
            predicted = (f"{plan.predicted_iteration_s * 1e3:.1f} ms/iteration predicted"
                         if plan.predicted_iteration_s else "no prediction")
            lines.append(f"  {label}: {plan.schedule}, {plan.microbatches} microbatches, {predicted}")
            for device, layers in _layout(plan):
                lines.append(f"    device {device} ({plan.devices[device].name}): {layers}")
        for device, (read, moved) in enumerate(zip(self.read_bytes, self.moved_bytes, strict=True)):
            lines.append(f"  device {device} read {format_bytes(read)}, {format_bytes(moved)} of it held elsewhere before")
        return "\n".join(lines)


def restore_into(pipe: Pipeline, directory: str | Path, report: bool, training_state: bool) -> Move:
    """Fill `pipe` from the checkpoint at `directory` (any plan of the same model) and say what moved;
    without `training_state` only the weights (the optimizer, step count and scheduler stay)."""
    pipe._executor.settle(broken_ok=True)
    return restore_checkpoint(pipe, read_checkpoint(directory, pipe.context), report, training_state)


def restore_checkpoint(pipe: Pipeline, saved: Checkpoint, report: bool, training_state: bool,
                       constants: bool = False) -> Move:
    """`restore_into` from a checkpoint read already; with `constants` also the tensors the stage
    code reads beside the state_dict (a re-planned pipeline's)."""
    if training_state:
        check_same_optimizer(saved.training.get("optimizer"), pipe._runtime.optimizer_factory)
    restore_state(pipe.plan, pipe._runtime, pipe._unheld, saved, constants=constants, training_state=training_state)
    if training_state:
        pipe._resumed = TrainingState.from_settings(saved.training)
    if training_state and pipe._optimizer is not None:
        pipe._optimizer.pull_hyperparameters()  # the saved learning rates, now in the stages' optimizers
    move = _move(saved.plan, pipe.plan, {k: v.size.numel() * v.properties.dtype.itemsize
                                         for k, v in saved.tensors.items()})
    if report and move.changed and (pipe.context is None or pipe.context.rank == 0):
        print(move)
    return move


def _layout(plan: Plan) -> list[tuple[int, str]]:
    """Per device, its stages' layers as first..last (the names of the model's layers)."""
    out = []
    for device in range(len(plan.devices)):
        layers = sorted(j for s in plan.stages if s.device == device for j in s.layers)
        out.append((device, f"{plan.layers[layers[0]].name} .. {plan.layers[layers[-1]].name} ({len(layers)} layers)"
                    if layers else "no layers"))
    return out


def _move(before: Plan, after: Plan, sizes: dict[str, int]) -> Move:
    """Bytes each device of `after` reads, and of those what its index did not hold in `before`."""
    per_name: Counter[str] = Counter()
    for key, size in sizes.items():
        if key.startswith(MODEL + "."):
            per_name[key[len(MODEL) + 1:]] += size
        elif key.startswith(OPTIMIZER_STATE + "."):
            per_name[key[len(OPTIMIZER_STATE) + 1:].rsplit(".", 1)[0]] += size
    held_before, held_after = _holders(before), _holders(after)
    read, moved = [0] * len(after.devices), [0] * len(after.devices)
    for name, size in per_name.items():
        for device in held_after.get(name, ()):
            read[device] += size
            if device not in held_before.get(name, ()):
                moved[device] += size
    return Move(before, after, tuple(read), tuple(moved))


def _holders(plan: Plan) -> dict[str, set[int]]:
    """Each state name (under every alias) -> the devices whose stages hold it."""
    holders: dict[str, set[int]] = {}
    for stage in plan.stages:
        for name in stage.params + stage.buffers:
            for alias in aliases_of(plan, name):
                holders.setdefault(alias, set()).add(stage.device)
    return holders
