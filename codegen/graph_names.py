"""Call targets named for a stage structure, and resolved from one (codegen/graph_data.py).

Saving names an op by its namespace, name and overload and a function, class or enum member by
the module and qualified name that give it back among the modules already imported (the user's
own functions included). Loading resolves a name only by exact match: from the caller's
trusted functions, else from the allowlist (codegen/allowlist.py); it never imports and never
walks attributes from the name it reads, and a refusal says how to trust a function.
"""

from __future__ import annotations

import enum
import sys
from collections.abc import Callable, Mapping

import torch

from stagewise.codegen import allowlist
from stagewise.codegen.module_skeleton import Encoded
from stagewise.ir.errors import CheckpointError, UntrustedCodeError


def callable_name(value: object) -> dict | None:
    """{"op": "aten.mm.default"}, {"function": [module, qualname]} or {"enum": [module, qualname, member]}
    where looking the name up gives `value` back; None where none does."""
    if isinstance(value, torch._ops.OpOverload | torch._ops.OpOverloadPacket):
        return {"op": _op_path(value)}
    if isinstance(value, torch._ops.OperatorBase):
        return None  # a higher-order op: it takes graphs
    if isinstance(value, enum.Enum):
        cls = _function_path(type(value))
        return None if cls is None else {"enum": [*cls, value.name]}
    found = _function_path(value) if callable(value) else None
    return None if found is None else {"function": found}


def _function_path(value: object) -> list[str] | None:
    """[module, qualname] of a module-level function or class, found by looking it up (no import)."""
    module = getattr(value, "__module__", None) or getattr(getattr(value, "__objclass__", None), "__module__", None)
    if not isinstance(module, str):
        return None
    for name in (getattr(value, "__qualname__", None), getattr(value, "__name__", None)):
        if isinstance(name, str) and "<" not in name and _lookup(module, name) is value:
            return [module, name]
    return None


def _lookup(module_name: str, qualname: str) -> object:
    """module_name.qualname among the modules already imported, else None: naming a value while
    saving (loading never looks a checkpoint's name up this way: codegen/allowlist.py)."""
    first, *rest = module_name.split(".")
    found = sys.modules.get(module_name) or _walk(sys.modules.get(first), rest)
    return _walk(found, qualname.split("."))


def _walk(obj: object, parts: list[str]) -> object:
    """obj.a.b for parts [a, b], None where an attribute is missing (nothing raised while describing)."""
    for part in parts:
        obj = getattr(obj, part, None) if obj is not None else None
    return obj


def trusted_names(trusted: Mapping[str, Callable]) -> dict[str, Callable]:
    """The caller's trusted functions under their given names and under the name a structure
    records them by (`torch.logsumexp`, whose __qualname__ is `_VariableFunctionsClass.logsumexp`)."""
    named = dict(trusted)
    for function in trusted.values():
        path = _function_path(function)
        if path is not None:
            named.setdefault(".".join(path), function)
    return named


def resolve(key: str, value: Encoded, trusted: Mapping[str, Callable]) -> object:
    """An op, function, class or enum member named by the data."""
    if key == "op":
        return _resolve_op(value, trusted)
    if not (isinstance(value, list) and len(value) == (3 if key == "enum" else 2) and all(isinstance(v, str) for v in value)):
        raise CheckpointError(f"a stage structure names a {key} as {value!r}")
    if key == "function":
        return _resolve_function(value[0], value[1], trusted)
    name = f"{value[0]}.{value[1]}"
    found = allowlist.allowed_enum(name)
    if found is None or not issubclass(found, enum.Enum) or value[2] not in found.__members__:
        raise UntrustedCodeError(f"it names the enum member {name}.{value[2]}, which is not among the enums a "
                                 "checkpoint may name (codegen/allowlist.py)")
    return found[value[2]]


def _resolve_op(path: object, trusted: Mapping[str, Callable]) -> object:
    """torch.ops.aten.<op>[.<overload>] (not a refused one), or an op the caller trusts; never an
    attribute of torch.ops other than `aten` (another namespace's ops may run Python)."""
    parts = path.split(".") if isinstance(path, str) else []
    # an op may be named like a dunder (aten.__and__); the overload may not
    if len(parts) not in (2, 3) or not all(p.isidentifier() for p in parts) or parts[-1].startswith("__"):
        raise CheckpointError(f"it names the op {path!r}, not namespace.op.overload")
    for op in trusted.values():
        if isinstance(op, torch._ops.OpOverload | torch._ops.OpOverloadPacket) and _op_path(op) == path:
            return op
    if parts[0] != "aten" or not allowlist.allowed_aten(parts[1]):
        why = ("ATen ops that reach files, print or change global state are refused" if parts[0] == "aten" else
               "a checkpoint calls ATen ops only (another namespace's may run Python)")
        raise UntrustedCodeError(f"it calls the op torch.ops.{path}: {why}; if you trust the op, pass it to the "
                                 f"load: sw.load(directory, trusted_functions=[torch.ops.{path}])")
    packet = getattr(torch.ops.aten, parts[1], None)
    registered = packet if len(parts) == 2 or packet is None else getattr(packet, parts[2], None)
    if not isinstance(registered, torch._ops.OpOverloadPacket if len(parts) == 2 else torch._ops.OpOverload):
        raise CheckpointError(f"it calls the op torch.ops.{path}, which this PyTorch has not registered")
    return registered


def _op_path(op: torch._ops.OpOverload | torch._ops.OpOverloadPacket) -> str:
    """An op's name in a structure: namespace.op.overload (a packet: namespace.op)."""
    if isinstance(op, torch._ops.OpOverload):
        return f"{op.namespace}.{op._opname}.{op._overloadname}"
    return op._qualified_op_name.replace("::", ".")


def _resolve_function(module_name: str, qualname: str, trusted: Mapping[str, Callable]) -> Callable:
    """A function or class by its exact qualified name: from `trusted` ({"module.qualname": it}),
    else from the allowlist (codegen/allowlist.py), else an UntrustedCodeError saying how to trust it."""
    name = f"{module_name}.{qualname}"
    found = trusted.get(name) or allowlist.allowed_function(name)
    if callable(found):
        return found
    short = qualname.rsplit(".", 1)[-1]
    raise UntrustedCodeError(
        f"it calls {name}, which is not among the functions a checkpoint may call (torch's tensor functions, "
        "ATen ops, Python's operators and stagewise's own: codegen/allowlist.py); if it is a function you "
        f"trust (your own loss function, or a torch function not on the list), pass it to the load: "
        f"sw.load(directory, trusted_functions=[{short}])"
    )
