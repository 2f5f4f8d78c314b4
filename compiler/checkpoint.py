"""Save a pipeline to a directory and load it back without the model class, running nothing from it.

Layout: plan.json (the whole IR, programs included), programs.txt and stage_<i>.py (to read:
the generated stage code, never run on load), stage_<i>.json (each stage module as data:
codegen/graph_data.py), weights/ (a torch.distributed.checkpoint of the weights under the
model's names, the optimizer state by parameter name and the stage code's other tensors:
compiler/checkpoint_dcp.py), graph.json (the whole graph compile planned, as data, to plan
again for other devices: compiler/model_graph.py), training.pt (step, optimizer class and groups, clipping, which
stages swap, scheduler state, the user's metadata; read with weights_only=True), stagewise.json
(the marker: format version, size and SHA-256 of every other file; load checks each file it
reads against it). Save never replaces anything but a stagewise checkpoint, and a crash at any
moment leaves the old or the new one loadable at the path (compiler/checkpoint_swap.py).

Under torch.distributed every rank writes its own stages' weights into the one DCP folder, so a
checkpoint across machines needs a filesystem they share (compiler/checkpoint_write.py). A
checkpoint is read back by `sw.load` (the saved plan, rebuilt from data, or on other devices its
graph planned again: compiler/replan.py) or, into a pipeline compiled again on other devices, by
`pipe.restore` (compiler/checkpoint_restore.py).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence

import torch
import torch.fx as fx

from stagewise.codegen.graph_data import materialize
from stagewise.compiler.checkpoint_arguments import checkpoint_path
from stagewise.compiler.checkpoint_arguments import trusted_functions as checked_trusted
from stagewise.compiler.checkpoint_read import Checkpoint, read_checkpoint, trusted_by_name
from stagewise.compiler.checkpoint_restore import restore_state, unheld_names
from stagewise.compiler.checkpoint_verify import rebuild_checkpoint
from stagewise.compiler.fx_sources import releasing_fx_sources
from stagewise.compiler.loss_reduction import reduction_from_data
from stagewise.compiler.optimizer_recipe import recorded_optimizer
from stagewise.compiler.options import check_flags
from stagewise.compiler.pipeline import Pipeline
from stagewise.compiler.runtime_setup import start_runtime
from stagewise.compiler.training_state import TrainingState, put_saved_mode
from stagewise.compiler.virtual_devices import remapped
from stagewise.ir.devices import resolve_devices
from stagewise.ir.errors import OptionError
from stagewise.runtime.launch import distributed_context


@releasing_fx_sources
def load(directory, trusted_functions: Sequence[Callable] = (), devices=None, replan: bool | None = None,
         report: bool = True) -> Pipeline:
    """A Pipeline from `pipe.save(directory)`, trained on from where it was saved. `trusted_functions`:
    functions and classes of yours the checkpoint names but never holds (a `loss_fn`, an optimizer
    class, a torch function or op that stagewise's allowlist does not list, codegen/allowlist.py);
    what the allowlist lists is found by its exact name, anything else is refused before it runs.

    `devices`: by default the devices it was saved on, with the saved plan. Other devices get a new
    plan, made from the graph the checkpoint keeps, without the model (Varuna's job morphing,
    compiler/replan.py; what moved is printed unless not `report`), except for a plan compiled with
    `virtual_devices`, whose devices are placed on them as `pipe.resize` places them (bitwise the
    same training, compiler/virtual_devices.py). `replan=True` / `False` asks for one or the other.

    In one process it holds every stage. Under torch.distributed (torchrun, one process per device
    of the plan) each rank builds every stage's code and reads only its own stages' state; the
    ranks agree that every one of them could read its part before any starts.
    """
    check_flags(report=report)
    if replan is not None:  # None: plan again only for other devices
        check_flags(replan=replan)
    directory, trusted_functions = checkpoint_path(directory, "sw.load"), checked_trusted(trusted_functions)
    context = distributed_context()
    saved = read_checkpoint(directory, context)
    trusted = trusted_by_name(trusted_functions)
    rebuilt = rebuild_checkpoint(saved, trusted)  # every name resolved before anything runs
    if _replans(saved, devices, replan):
        from stagewise.compiler.replan import replan as plan_again  # the re-plan compiles: it sits above

        return plan_again(saved, rebuilt.graph, devices, trusted, report)
    plan = saved.plan if devices is None else remapped(saved.plan, devices)
    modules = _stage_modules(saved, rebuilt.stages, None if context is None else context.rank)
    training = saved.training
    optimizer = recorded_optimizer(training.get("optimizer"), training.get("optimizer_groups", []), plan.aliases,
                                   trusted)
    runtime = start_runtime(plan, modules, optimizer, training.get("clip_grad_norm"),
                            frozenset(training.get("swapped", ())))
    unheld = _unheld(saved)
    restore_state(plan, runtime, unheld, saved, constants=True)
    pipe = Pipeline(plan, runtime, unheld=unheld)
    pipe.resumed = TrainingState.from_settings(training)
    pipe.loss_reduction = reduction_from_data(training.get("loss_reduction"))  # checked against the plan
    put_saved_mode(pipe, training)
    pipe.model_graph = saved.model_graph  # its next checkpoint can be planned again as well
    return pipe


def _replans(saved: Checkpoint, devices, replan: bool | None) -> bool:
    """Whether `load` plans again for `devices` (its docstring): asked, or other devices than the
    saved plan's and a plan not made for virtual devices."""
    if replan is not None:
        if replan and devices is None:
            raise OptionError("sw.load(..., replan=True) plans for other devices: give them, devices=[...]")
        return replan
    if devices is None:
        return False
    given = resolve_devices(devices)
    if [d.spec() for d in given] == list(saved.plan.devices):
        return False
    graph = saved.model_graph or {}
    if graph.get("options", {}).get("virtual_devices") is not None:
        return False
    if "graph" not in graph:
        warnings.warn(f"{saved.root} keeps no graph to plan again from ({graph.get('unavailable', 'saved before')}"
                      f"): its plan's {len(saved.plan.devices)} devices are placed on the {len(given)} given; "
                      "for a plan made for them, compile the model and call pipe.restore(directory)", stacklevel=3)
        return False
    return True


def _stage_modules(saved: Checkpoint, stages: list[fx.GraphModule], rank: int | None) -> list[fx.GraphModule]:
    """The rebuilt stages (meta): this process's given CPU memory (filled by the restore), another
    rank's left on the meta device (its shapes only)."""
    return [materialize(module, "cpu") if rank is None or stage.device == rank else module
            for stage, module in zip(saved.plan.stages, stages, strict=True)]


def _unheld(saved: Checkpoint) -> dict[str, torch.Tensor]:
    """Empty tensors, of the saved shapes, for the state no stage holds (the restore fills them)."""
    shapes = saved.tensors
    return {n: torch.empty(tuple(shapes[f"model.{n}"].size), dtype=shapes[f"model.{n}"].properties.dtype)
            for n in unheld_names(saved.plan) if f"model.{n}" in shapes}
