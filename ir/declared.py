"""Dtypes and shapes as a file declares them (plan.json, a stage structure, graph.json), read
without trusting the file.

Why not `getattr(torch, name)`: a crafted name such as "load" or "set_default_device" would
return a torch function, and a name of one of torch's lazy submodules would import it. `DTYPES`
holds torch's dtypes and nothing else, so any other name is refused. A shape is plain ints whose
product torch can index, so a size computed from it never overflows.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from types import MappingProxyType

import torch

from stagewise.ir.errors import CheckpointError

DTYPES: Mapping[str, torch.dtype] = MappingProxyType(
    {name: value for name, value in vars(torch).items() if isinstance(value, torch.dtype)})
ALTERED = "stagewise never writes this: the checkpoint was altered; save the pipeline again"
_MAX_DIMS = 64
_MAX_NUMEL = 1 << 62  # beyond it numel × element size overflows torch's int64


def known_dtype(name: object) -> torch.dtype | None:
    """The dtype `name` names ("float32", or as torch prints it, "torch.float32"), else None."""
    return DTYPES.get(name.removeprefix("torch.")) if isinstance(name, str) else None


def dtype_named(name: object, where: str) -> torch.dtype:
    """`known_dtype(name)`, or a CheckpointError naming `where` and the name."""
    dtype = known_dtype(name)
    if dtype is None:
        raise CheckpointError(f"{where} gives the dtype {str(name)[:80]!r}, which is no torch dtype; {ALTERED}")
    return dtype


def plain_shape(value: object) -> tuple[int, ...] | None:
    """`value` as a shape (at most 64 non-negative ints of a product torch can index), else None."""
    if not (isinstance(value, tuple | list) and len(value) <= _MAX_DIMS
            and all(type(s) is int and s >= 0 for s in value)):
        return None
    return tuple(value) if math.prod(value) < _MAX_NUMEL else None
