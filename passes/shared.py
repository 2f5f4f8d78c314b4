"""Tensors held by more than one stage (Varuna §5.2, cross-partition shared state).

A tied input embedding / LM head is one Parameter under two FQNs; once the two users land
in different stages, each stage holds a replica. The runtime sums the replicas' gradients
before the update (an all-reduce among the holders), so every replica takes the same step
and the tie holds after every iteration. Identity, not names, decides what is shared.
"""

from __future__ import annotations

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
                                   tensor.nelement() * tensor.element_size()))
    return tuple(shared)


def alias_groups(gm: fx.GraphModule) -> list[tuple[str, ...]]:
    """Every group of FQNs that name one tensor (tied weights), whether or not it is split."""
    groups: dict[int, list[str]] = {}
    for name, tensor in list(gm.named_parameters(remove_duplicate=False)) + list(gm.named_buffers(remove_duplicate=False)):
        groups.setdefault(id(tensor), []).append(name)
    return [tuple(g) for g in groups.values() if len(g) > 1]
