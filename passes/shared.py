"""Tensors held by more than one stage (Varuna §5.2, cross-partition shared state).

A tied input embedding / LM head is one Parameter under two FQNs; once the two users land
in different stages, each stage holds a replica. The runtime sums the replicas' gradients
before the update (an all-reduce among the holders), so every replica takes the same step
and the tie holds after every iteration. Identity, not names, decides what is shared.

The names come from the user's model, not the graph: a traced graph keeps one name per tensor
(fx names a module called at two places by its first name) and drops what the loss never
reads, yet `pipe.state_dict()` must have every key the model's has.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from stagewise.ir.plan import SharedTensor, Stage


def find_shared(gm: fx.GraphModule, stages: tuple[Stage, ...]) -> tuple[SharedTensor, ...]:
    params = dict(gm.named_parameters(remove_duplicate=False))
    tensors = {**dict(gm.named_buffers(remove_duplicate=False)), **params}
    names_of: dict[int, list[str]] = {}
    for name, tensor in tensors.items():
        names_of.setdefault(id(tensor), []).append(name)
    holders: dict[int, list[int]] = {}
    for stage in stages:
        for name in stage.params + stage.buffers:
            if name in tensors:
                holders.setdefault(id(tensors[name]), [])
                if stage.index not in holders[id(tensors[name])]:
                    holders[id(tensors[name])].append(stage.index)
    shared = []
    for key, stage_ids in holders.items():
        if len(stage_ids) < 2:
            continue
        names = tuple(names_of[key])
        if names[0] not in params:
            kind = "buffer"
        else:
            kind = "tied-parameter" if len(names) > 1 else "parameter"
        tensor = tensors[names[0]]
        shared.append(SharedTensor(names[0], names, tuple(sorted(stage_ids)), kind,
                                   tensor.nelement() * tensor.element_size(),
                                   trainable=kind != "buffer" and tensor.requires_grad))
    return tuple(shared)


def alias_groups(model: torch.nn.Module) -> list[tuple[str, ...]]:
    """Every group of FQNs that name one tensor in `model`: tied weights, and each name of a module
    registered under several (called at two depths), whether or not the graph uses that name."""
    groups: dict[int, list[str]] = {}
    for name, tensor in _named_state(model):
        groups.setdefault(id(tensor), []).append(name)
    return [tuple(g) for g in groups.values() if len(g) > 1]


def unheld_state(model: torch.nn.Module, stages: tuple[Stage, ...]) -> dict[str, torch.Tensor]:
    """The state_dict entries of `model` that no stage holds under any of their names (a layer
    the loss never reaches), copied to the CPU, tied names sharing one copy. No gradient ever
    reaches them, so training leaves them as they are; the pipeline keeps and saves them."""
    held = {name for stage in stages for name in stage.params + stage.buffers}
    holders: dict[int, set[str]] = {}
    for name, tensor in _named_state(model):
        holders.setdefault(id(tensor), set()).add(name)
    copies: dict[int, torch.Tensor] = {}
    unheld = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        if isinstance(tensor, torch.Tensor) and held.isdisjoint(holders.get(id(tensor), {name})):
            if id(tensor) not in copies:
                copies[id(tensor)] = tensor.detach().to("cpu", copy=True)
            unheld[name] = copies[id(tensor)]
    return unheld


def _named_state(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Every (FQN, tensor) of parameters and buffers, each name of a tensor with several."""
    return [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]
