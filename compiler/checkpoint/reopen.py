"""A runtime started from a checkpoint's saved plan, holding its state.

`sw.load` wraps it in a `Pipeline` (compiler/elastic/load.py) and `pipe.resize` swaps it in for the
pipeline's own runtime (compiler/pipeline/virtual_devices.py): both run the saved plan, so neither
needs the compiler, and the pipeline can reach it without an import cycle.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
import torch.fx as fx

from stagewise.codegen.graph_data import materialize
from stagewise.compiler.assembly.optimizer_recipe import recorded_optimizer
from stagewise.compiler.assembly.runtime_setup import Runtime, start_runtime
from stagewise.compiler.assembly.stage_acceleration import loaded_acceleration
from stagewise.compiler.checkpoint.read import Checkpoint
from stagewise.compiler.checkpoint.restore import restore_state, unheld_names
from stagewise.ir.plan import Plan
from stagewise.runtime.launch import DistributedContext


def reopen(saved: Checkpoint, stages: list[fx.GraphModule], plan: Plan, trusted: Mapping[str, Callable],
           context: DistributedContext | None) -> tuple[Runtime, dict[str, torch.Tensor]]:
    """`saved`'s state in a runtime of `plan` (the saved plan, perhaps on other physical devices) over
    the `stages` rebuilt from it (compiler/checkpoint/verify.py), and the state no stage holds."""
    modules = _stage_modules(saved, stages, None if context is None else plan.rank_layout().device_of(context.rank))
    training = saved.training
    optimizer = recorded_optimizer(training.get("optimizer"), training.get("optimizer_groups", []), plan.aliases,
                                   trusted)
    acceleration = loaded_acceleration(training.get("acceleration"), plan, modules)
    runtime = start_runtime(plan, modules, optimizer, training.get("clip_grad_norm"),
                            frozenset(training.get("swapped", ())), acceleration=acceleration)
    unheld = _unheld(saved)
    restore_state(plan, runtime, unheld, saved, constants=True)
    return runtime, unheld


def _stage_modules(saved: Checkpoint, stages: list[fx.GraphModule], device: int | None) -> list[fx.GraphModule]:
    """The rebuilt stages (meta): this process's (on its pipeline `device`) given CPU memory (filled by
    the restore), another rank's left on the meta device (its shapes only)."""
    return [materialize(module, "cpu") if device is None or stage.device == device else module
            for stage, module in zip(saved.plan.stages, stages, strict=True)]


def _unheld(saved: Checkpoint) -> dict[str, torch.Tensor]:
    """Empty tensors, of the saved shapes, for the state no stage holds (the restore fills them)."""
    shapes = saved.tensors
    return {n: torch.empty(tuple(shapes[f"model.{n}"].size), dtype=shapes[f"model.{n}"].properties.dtype)
            for n in unheld_names(saved.plan) if f"model.{n}" in shapes}
