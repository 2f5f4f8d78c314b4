"""The training state of a pipeline by the original model's names, out of the stages and back in.

A checkpoint keys everything by the model's names, not by stage: the weights under
`model.state_dict()`'s keys, each parameter's optimizer tensors under that parameter's name, the
optimizer's groups as lists of names with their hyper-parameters (compiler/checkpoint/dcp.py
says where each goes). So any plan of the same model reads it back: each stage takes the names
it holds, whatever stage held them when it was saved (Varuna §4.5, job morphing). Tensors go to
DCP; the few non-tensor entries of an optimizer's state (a step count kept as an int) go with
the training loop's state in training.pt.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field

import torch

from stagewise.codegen.graph_data import stage_tensors
from stagewise.compiler.assembly.state_dict import aliases_of, model_name
from stagewise.compiler.checkpoint.dcp import CONSTANTS, MODEL, NEWEST, OPTIMIZER_STATE
from stagewise.compiler.checkpoint.shards import SavedSplit, split_for_saving
from stagewise.ir.errors import CheckpointError
from stagewise.ir.plan import Plan
from stagewise.runtime.worker import StageWorker

_OWN_KEYS = ("params", "param_names")


@dataclass
class SavedState:
    """This process's part of a checkpoint: DCP tensors by flattened key, and the rest."""

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    optimizer_values: dict[str, dict[str, object]] = field(default_factory=dict)  # name -> non-tensor entries
    groups: list[dict] = field(default_factory=list)  # per group: hyper-parameters and this process's names
    split: SavedSplit = field(default_factory=SavedSplit)  # which tensors are chunks of a whole (tensor_parallel)


def stage_constants(plan: Plan, worker: StageWorker) -> dict[str, torch.Tensor]:
    """The tensors the stage code reads that are not in the model's state_dict (non-persistent
    buffers, constants torch.export lifted): a checkpoint keeps them for loading without the model."""
    state_names = set(plan.state_names)
    return {n: t for n, t in stage_tensors(worker.module).items() if n not in state_names and n not in worker.params}


def saved_state(plan: Plan, workers: list[StageWorker], unheld: dict[str, torch.Tensor],
                constants: dict[int, dict[str, torch.Tensor]]) -> SavedState:
    """The state of this process's stages (and the tensors no stage holds) under the model's
    names; `constants`: per stage, the tensors its code reads that are not in the state_dict."""
    saved = SavedState()
    state_names = set(plan.state_names)
    for name, tensor in unheld.items():
        saved.tensors.setdefault(f"{MODEL}.{name}", tensor.detach().cpu())
    for worker in workers:
        for name, tensor in worker.state_tensors().items():
            for alias in aliases_of(plan, name):
                if alias in state_names:
                    saved.tensors.setdefault(f"{MODEL}.{alias}", tensor.detach().cpu())
        for name, tensor in constants.get(worker.stage.index, {}).items():
            saved.tensors.setdefault(f"{CONSTANTS}.{name}", tensor.detach().cpu())
        for name, tensor in worker.weight_versions.newest.items():  # 2bw's other version
            saved.tensors.setdefault(f"{NEWEST}.{_saved_name(plan, name)}", tensor.detach().cpu())
        _add_optimizer(plan, worker, saved)
    saved.split = split_for_saving(saved.tensors, plan.tensor_parallel)
    return saved


def _add_optimizer(plan: Plan, worker: StageWorker, saved: SavedState) -> None:
    """The stage's optimizer state under its parameters' model names; a parameter two stages
    hold (tied) keeps its first holder's, as `pipe.optimizer.state_dict()` does."""
    state = worker.optimizer_state()
    if state is None or worker.optimizer is None:
        return
    order = [p for group in worker.optimizer.param_groups for p in group["params"]]
    names = {id(p): model_name(plan, n) for n, p in worker.params.items()}
    for index, values in state["state"].items():
        name = names[id(order[index])]
        if name in saved.optimizer_values:
            continue
        saved.optimizer_values[name] = {k: v for k, v in values.items() if not isinstance(v, torch.Tensor)}
        for key, value in values.items():
            if isinstance(value, torch.Tensor):
                saved.tensors[f"{OPTIMIZER_STATE}.{name}.{key}"] = value
    while len(saved.groups) < len(worker.optimizer.param_groups):
        saved.groups.append({"param_names": []})
    for index, group in enumerate(worker.optimizer.param_groups):
        saved.groups[index].update({k: v for k, v in state["param_groups"][index].items() if k not in _OWN_KEYS})
        saved.groups[index]["param_names"] += [names[id(p)] for p in group["params"]]


def merged_groups(parts: list[list[dict]], plan: Plan) -> list[dict]:
    """Every process's groups as one list: hyper-parameters, and the names in the model's order."""
    position = {n: i for i, n in enumerate(plan.state_names)}
    count = max((len(p) for p in parts), default=0)
    merged = []
    for index in range(count):
        groups = [p[index] for p in parts if len(p) > index]
        names = sorted({n for g in groups for n in g["param_names"]}, key=lambda n: position.get(n, len(position)))
        merged.append({**{k: v for k, v in groups[0].items() if k != "param_names"}, "param_names": names})
    return merged


def wanted_tensors(plan: Plan, workers: list[StageWorker], unheld: dict[str, torch.Tensor],
                   constants: dict[int, dict[str, torch.Tensor]]
                   ) -> tuple[dict[str, torch.Tensor], list[tuple[str, torch.Tensor]]]:
    """The tensors this process fills from a checkpoint, by flattened key: its stages' weights
    (host copies where swapped), the unheld state, and `constants` (stage -> name -> tensor); and
    the further tensors of a key two local stages hold (a tied weight), to copy once it is read."""
    wanted: dict[str, torch.Tensor] = {}
    copies: list[tuple[str, torch.Tensor]] = []
    seen: set[int] = set()
    state_names = set(plan.state_names)

    def want(key: str, tensor: torch.Tensor) -> None:
        if id(tensor) in seen:
            return
        seen.add(id(tensor))
        if key in wanted:
            copies.append((key, tensor))
        else:
            wanted[key] = tensor

    for name, tensor in unheld.items():
        want(f"{MODEL}.{name}", tensor)
    for worker in workers:
        for name, tensor in worker.state_tensors().items():
            saved_name = _saved_name(plan, name)
            if saved_name in state_names:  # else a constant: below, if asked for
                want(f"{MODEL}.{saved_name}", tensor)
        for name, tensor in constants.get(worker.stage.index, {}).items():
            want(f"{CONSTANTS}.{name}", tensor)
    return wanted, copies


def newest_tensors(plan: Plan, workers: list[StageWorker], saved: Collection[str]
                   ) -> tuple[list[tuple[str, torch.Tensor]], list[StageWorker]]:
    """2bw's newest weights to fill from a checkpoint that keeps them (`saved`: its keys), by key, and
    the stages whose checkpoint does not (a synchronous plan's: both versions start as its weights)."""
    found: list[tuple[str, torch.Tensor]] = []
    unsaved: list[StageWorker] = []
    for worker in workers:
        keys = {f"{NEWEST}.{_saved_name(plan, n)}": t for n, t in worker.weight_versions.newest.items()}
        if keys and not all(key in saved for key in keys):
            unsaved.append(worker)
            continue
        found += keys.items()
    return found, unsaved


def _saved_name(plan: Plan, name: str) -> str:
    """The key a stage's tensor is saved under: its first name in the model's state_dict."""
    state_names = set(plan.state_names)
    return next((a for a in aliases_of(plan, name) if a in state_names), name)


def optimizer_tensors(plan: Plan, worker: StageWorker, saved: dict[str, tuple[tuple[int, ...], torch.dtype]]
                      ) -> dict[str, torch.Tensor]:
    """Empty CPU tensors for every saved optimizer tensor of the stage's parameters, by flattened key
    (`saved`: the checkpoint's tensors, key -> size and dtype), for DCP to fill."""
    if worker.optimizer is None:
        return {}
    names = {model_name(plan, n) for n in worker.params}
    out = {}
    for key, (size, dtype) in saved.items():
        if key.startswith(OPTIMIZER_STATE + ".") and key[len(OPTIMIZER_STATE) + 1:].rsplit(".", 1)[0] in names:
            out[key] = torch.empty(size, dtype=dtype)
    return out


def stage_optimizer_state(plan: Plan, worker: StageWorker, filled: dict[str, torch.Tensor],
                          values: dict[str, dict], groups: list[dict]) -> dict | None:
    """The stage's optimizer state_dict (by position, as torch's `load_state_dict` takes it) from
    the checkpoint's state by name: this stage's own groups, the saved groups' hyper-parameters."""
    optimizer = worker.optimizer
    if optimizer is None:
        return None
    if len(groups) != len(optimizer.param_groups):
        raise CheckpointError(f"the checkpoint's optimizer has {len(groups)} parameter groups, this pipeline's "
                              f"{len(optimizer.param_groups)}: restore it with the optimizer it was saved with")
    names = {id(p): model_name(plan, n) for n, p in worker.params.items()}
    order = [p for group in optimizer.param_groups for p in group["params"]]
    state: dict[int, dict] = {}
    for index, param in enumerate(order):
        name = names[id(param)]
        entry = dict(values.get(name, {}))
        prefix = f"{OPTIMIZER_STATE}.{name}."
        entry.update({k[len(prefix):]: t for k, t in filled.items() if k.startswith(prefix) and "." not in k[len(prefix):]})
        if entry:
            state[index] = entry
    positions = {id(p): i for i, p in enumerate(order)}
    param_groups = [{**{k: v for k, v in saved.items() if k not in _OWN_KEYS},
                     "params": [positions[id(p)] for p in group["params"]]}
                    for saved, group in zip(groups, optimizer.param_groups, strict=True)]
    return {"state": state, "param_groups": param_groups}
