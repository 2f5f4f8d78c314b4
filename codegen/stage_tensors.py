"""A stage's tensors as data: each one the graph reads described by name (kind, shape, dtype, or
the name it is a tie of), built back as empty meta tensors, and materialized with the ties kept.

Why apart from the leaves' skeletons (module_skeleton.py): these records are what a checkpoint
declares it will allocate, so they are checked here (`declared_tensor`: a plain shape and dtype)
and against the checkpoint's weights (compiler/checkpoint/limits.py) before `materialize`
allocates them.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from itertools import chain
from typing import Any, TypeVar

import torch
import torch.fx as fx
from torch import nn

from stagewise.ir.declared import known_dtype, plain_shape
from stagewise.ir.errors import CheckpointError, PlanError

_M = TypeVar("_M", bound=nn.Module)


def stage_tensors(module: fx.GraphModule) -> dict[str, torch.Tensor]:
    """Every tensor attribute the graph reads, by FQN (get_attr targets and the leaves' parameters
    and buffers, in graph order), once per alias group: the name it was first read under."""
    owners: dict[int, str] = {}
    for fqn, tensor in _reads(module):
        owners.setdefault(id(tensor), fqn)
    tensors = dict(_reads(module))
    return {fqn: tensors[fqn] for fqn in owners.values()}


def materialize(module: _M, device: torch.device | str) -> _M:
    """`module.to_empty(device=device)` with its ties kept: to_empty gives each module that holds a
    tied tensor a new one of its own, so the other names are pointed at the first again."""
    groups: dict[int, list[str]] = {}
    for fqn, tensor in chain(module.named_parameters(remove_duplicate=False), module.named_buffers(remove_duplicate=False)):
        groups.setdefault(id(tensor), []).append(fqn)
    module.to_empty(device=device)
    for owner, *aliases in groups.values():
        for alias in aliases:
            put_tensor(module, alias, attribute(module, owner))
    return module


def describe_tensors(module: fx.GraphModule) -> dict[str, dict]:
    """Each tensor the graph reads by FQN: its kind, and its shape, dtype and requires_grad or the
    name it was first read under (a tie)."""
    owners: dict[int, str] = {}
    records: dict[str, dict] = {}
    for fqn, tensor in _reads(module):
        if fqn in records:
            continue
        if type(tensor) not in (torch.Tensor, nn.Parameter) or tensor.layout != torch.strided:
            raise PlanError(f"the stage reads {fqn}, a {type(tensor).__name__} of layout {tensor.layout}: "
                            "only plain dense tensors can be described as data")
        parent, name = parent_of(module, fqn)
        kind = "parameter" if name in parent._parameters else "buffer" if name in parent._buffers else "constant"
        record: dict = {"kind": kind}
        if kind == "buffer":
            record["persistent"] = name not in parent._non_persistent_buffers_set
        owner = owners.setdefault(id(tensor), fqn)
        if owner != fqn:
            record["alias_of"] = owner
        else:
            record.update(shape=list(tensor.shape), dtype=str(tensor.dtype).removeprefix("torch."),
                          requires_grad=tensor.requires_grad)
        records[fqn] = record
    return records


def _reads(module: fx.GraphModule) -> Iterator[tuple[str, torch.Tensor]]:
    """(FQN, tensor) of every tensor the graph reads, in graph order, repeats included."""
    for node in module.graph.nodes:
        if node.op not in ("get_attr", "call_module"):
            continue
        value = attribute(module, node.target)
        if isinstance(value, torch.Tensor):
            yield node.target, value
        elif isinstance(value, nn.Module):
            yield from value.named_parameters(prefix=node.target, remove_duplicate=False)
            yield from value.named_buffers(prefix=node.target, remove_duplicate=False)
        else:
            raise PlanError(f"node {node.name!r} reads {node.target}, a {type(value).__name__}: "
                            "not a tensor or a torch.nn module")


def declared_tensor(fqn: str, record: object) -> tuple[tuple[int, ...], torch.dtype]:
    """The shape and dtype a stage structure's record of a tensor (not a tie) declares."""
    name = str(record.get("dtype")) if isinstance(record, dict) else ""
    dtype = known_dtype(name)
    shape = plain_shape(record.get("shape")) if isinstance(record, dict) else None
    if dtype is None or shape is None:
        raise CheckpointError(f"the stage structure describes the tensor {fqn} as {str(record)[:200]}")
    return shape, dtype


def meta_tensors(records: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """An empty meta tensor per recorded owner, and each alias the very tensor of its owner."""
    made: dict[str, torch.Tensor] = {}
    for fqn, record in records.items():
        if isinstance(record, dict) and "alias_of" in record:
            continue
        shape, dtype = declared_tensor(fqn, record)
        tensor = torch.empty(shape, dtype=dtype, device="meta")
        grad = bool(record.get("requires_grad", False))
        made[fqn] = nn.Parameter(tensor, requires_grad=grad) if record.get("kind") == "parameter" else tensor.requires_grad_(grad)
    for fqn, record in records.items():
        if "alias_of" in record:
            if record["alias_of"] not in made:
                raise CheckpointError(f"{fqn} is recorded as a tie of {record['alias_of']}, which is no tensor of the stage")
            made[fqn] = made[record["alias_of"]]
    return made


def put_tensor(root: nn.Module, fqn: str, tensor: torch.Tensor) -> None:
    """Point the parameter or buffer slot `fqn` at `tensor`."""
    parent, name = parent_of(root, fqn)
    if name in parent._parameters:
        if not isinstance(tensor, nn.Parameter):
            raise CheckpointError(f"{fqn} is a parameter of its module, but the stage structure makes it a buffer")
        parent._parameters[name] = tensor
    else:
        parent._buffers[name] = tensor


def parent_of(root: nn.Module, fqn: str) -> tuple[nn.Module, str]:
    """The module holding `fqn` and the attribute's name there."""
    prefix, _, name = fqn.rpartition(".")
    return (root.get_submodule(prefix) if prefix else root), name


def attribute(root: nn.Module, target: str) -> Any:
    """`root.a.b.c` for target 'a.b.c' (a tensor, a module or anything else)."""
    obj: Any = root
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def mark_persistence(module: nn.Module, tensors: Mapping[str, Any]) -> None:
    """Buffers persistent or not as recorded; constants (fx.GraphModule made them persistent buffers)
    non-persistent buffers, which `to_empty` moves and a state_dict leaves out, as it left them out."""
    for fqn, record in tensors.items():
        parent, name = parent_of(module, fqn)
        if name in parent._buffers and record.get("kind") == "buffer" and record.get("persistent", True):
            parent._non_persistent_buffers_set.discard(name)
        elif name in parent._buffers:
            parent._non_persistent_buffers_set.add(name)
