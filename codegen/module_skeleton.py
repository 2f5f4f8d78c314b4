"""torch.nn leaf modules as data (a class's importable path and its constructor arguments), and
the codec of plain values that codegen/graph_data.py extends with nodes, dtypes and call targets.

Why: a checkpoint must bring back the torch.nn leaves an fx-traced stage calls (nn.Linear,
nn.Conv2d, ...) without pickling them. torch.nn keeps each constructor argument under its own
name, so the arguments are read back from the instance (`inspect.signature(cls.__init__)`), a
tensor slot such as `bias` as whether it holds one. The reading is a heuristic, so every skeleton
is rebuilt on the meta device when it is described and compared with the original (repr, the
names and shapes of its parameters and buffers): a module it does not reproduce is recorded as
not rebuildable rather than coming back different. Only the torch.nn classes the allowlist
names (codegen/allowlist.py) are ever rebuilt, so a skeleton cannot name code outside them.
"""

from __future__ import annotations

import inspect
import json
import math
from collections.abc import Callable, Iterator, Mapping
from itertools import chain
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from stagewise.codegen.allowlist import allowed_leaf
from stagewise.codegen.stage_tensors import attribute, meta_tensors, put_tensor
from stagewise.ir.errors import CheckpointError

Encoded = Any  # a JSON value: None, bool, int, float, str, list, or a dict of str keys
_SMALL_ARGUMENT = 1 << 16  # a kernel size, padding or head count any module may take, whatever its tensors


class NotPlainValue(Exception):
    """Raised by an `other` hook of the codec for a value it cannot write either."""


def encode_plain(value: object, other: Callable[[object], Encoded]) -> Encoded:
    """`value` as JSON: None, bool, int, str and finite floats as themselves, lists as arrays, and
    a one-key object for the rest ({"tuple": [...]}, {"dict": [[k, v], ...]}, {"float": "inf"}), so
    that reading it back gives the same Python types (a dict keeps its order, whatever sort_keys).
    Anything else goes to `other`."""
    if value is None or type(value) in (bool, int, str):
        return value
    if type(value) is float:
        return value if math.isfinite(value) else {"float": repr(value)}
    if isinstance(value, list):  # fx's immutable_list included
        return [encode_plain(v, other) for v in value]
    if type(value) is tuple:
        return {"tuple": [encode_plain(v, other) for v in value]}
    if isinstance(value, dict):  # fx's immutable_dict included
        return {"dict": [[encode_plain(k, other), encode_plain(v, other)] for k, v in value.items()]}
    return other(value)


def decode_plain(data: Encoded, other: Callable[[str, Encoded], object]) -> Any:
    """The value `encode_plain` wrote; a one-key object it does not know goes to `other(key, value)`."""
    if data is None or type(data) in (bool, int, float, str):
        return data
    if isinstance(data, list):
        return [decode_plain(v, other) for v in data]
    if not isinstance(data, dict) or len(data) != 1:
        raise CheckpointError(f"a stage structure holds {data!r}, which is not an encoded value")
    (key, value), = data.items()
    if key == "tuple" and isinstance(value, list):
        return tuple(decode_plain(v, other) for v in value)
    if key == "dict" and isinstance(value, list):
        return {decode_plain(k, other): decode_plain(v, other) for k, v in value}
    if key == "float" and value in ("inf", "-inf", "nan"):
        return float(value)
    return other(key, value)


def _no_other(value: object) -> Encoded:
    """Constructor arguments are plain values only: anything else makes the module not rebuildable."""
    raise NotPlainValue(repr(value))


def _refuse_other(key: str, value: Encoded) -> object:
    """A skeleton's arguments hold plain values only (no functions, nodes or devices)."""
    raise CheckpointError(f"a module skeleton holds {{{key!r}: {value!r}}}, which is not a plain value")


class _NotRebuildable(Exception):
    """Why a module cannot be described as a skeleton."""


def describe_module(module: nn.Module) -> dict:
    """{"class": [module, qualname], "arguments": {...}, "training": bool, "rebuildable": true}, or
    {"class": ..., "rebuildable": false, "reason": ...} where the module is not a torch.nn class or
    its rebuilt twin differs (not an error: only loading such a structure is)."""
    cls = type(module)
    path = [str(getattr(cls, "__module__", "")), cls.__qualname__]
    try:
        _check_class(cls, path)
        if module._forward_hooks or module._forward_pre_hooks:
            raise _NotRebuildable("it has forward hooks, which are code")
        skeleton = {"class": path, "arguments": _constructor_arguments(module),
                    "training": module.training, "rebuildable": True}
        _check_twin(module, json.loads(json.dumps(skeleton)))
    except _NotRebuildable as reason:
        return {"class": path, "rebuildable": False, "reason": str(reason)}
    except Exception as error:  # noqa: BLE001 - an attribute that fails to read: not an error while saving
        return {"class": path, "rebuildable": False, "reason": f"reading it failed: {type(error).__name__}"}
    return skeleton


def _check_class(cls: type, path: list[str]) -> None:
    """The class is in torch.nn and its path, looked up as loading will, gives the class back."""
    module_name, qualname = path
    if not (module_name == "torch.nn" or module_name.startswith("torch.nn.")):
        raise _NotRebuildable(f"{'.'.join(path)} is not a torch.nn class")
    try:
        found = torch_nn_class(path)
    except CheckpointError as error:
        raise _NotRebuildable(str(error)) from None
    if found is not cls:
        raise _NotRebuildable(f"{'.'.join(path)} does not name the module's class")


def _constructor_arguments(module: nn.Module) -> dict[str, Encoded]:
    """Each argument of the class's __init__ read from the attribute of its name (device and
    dtype left out: the module is rebuilt on the meta device and its tensors get theirs after)."""
    arguments: dict[str, Encoded] = {}
    signature = inspect.signature(type(module).__init__)
    for name, parameter in list(signature.parameters.items())[1:]:
        if parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD) or name in ("device", "dtype"):
            continue
        if parameter.kind is parameter.POSITIONAL_ONLY:
            raise _NotRebuildable(f"its constructor argument {name!r} is positional-only")
        if name in module._parameters or name in module._buffers:
            arguments[name] = _tensor_slot(name, getattr(module, name), parameter.default)
            continue
        if not hasattr(module, name):
            if parameter.default is parameter.empty:
                raise _NotRebuildable(f"no attribute holds its constructor argument {name!r}")
            continue
        value = getattr(module, name)
        try:
            arguments[name] = (_tensor_slot(name, value, parameter.default) if isinstance(value, torch.Tensor)
                               else encode_plain(value, _no_other))
        except NotPlainValue:
            raise _NotRebuildable(f"its constructor argument {name!r} is a {type(value).__qualname__}, "
                                  "not a plain value") from None
    return arguments


def _tensor_slot(name: str, value: torch.Tensor | None, default: object) -> bool | None:
    """A constructor argument that names a parameter or buffer slot: a flag (`bias=True`) says
    whether the slot holds a tensor; an optional tensor argument (`weight=None`) can only be empty."""
    if isinstance(default, bool):
        return value is not None
    if value is None:
        return None
    raise _NotRebuildable(f"its constructor argument {name!r} is a tensor")


def _check_twin(module: nn.Module, skeleton: dict) -> None:
    """The skeleton rebuilt on the meta device has the module's repr, tensors and their shapes."""
    try:
        twin = rebuild_module(skeleton)
    except CheckpointError as error:
        raise _NotRebuildable(str(error)) from None
    if repr(twin) != repr(module):
        raise _NotRebuildable(f"rebuilt from its constructor arguments it is {twin!r}, not {module!r}")
    ours, theirs = _tensor_layout(twin), _tensor_layout(module)
    if ours != theirs:
        differ = [(a, b) for a, b in zip(ours, theirs, strict=True) if a != b][0]
        raise _NotRebuildable(f"rebuilt from its constructor arguments it holds {differ[0]}, not {differ[1]}")


def _tensor_layout(module: nn.Module) -> tuple:
    """Names and shapes of the parameters and buffers, and which are saved in a state_dict."""
    return ([(n, tuple(p.shape)) for n, p in module.named_parameters(remove_duplicate=False)],
            [(n, tuple(b.shape)) for n, b in module.named_buffers(remove_duplicate=False)],
            list(module.state_dict(keep_vars=True)))


def rebuild_module(skeleton: dict, limit: int | None = None) -> nn.Module:
    """The module a skeleton describes, on the meta device; a CheckpointError for one that was
    recorded as not rebuildable (it is loaded by compiling the model again and restoring into it),
    or, with a `limit`, one whose constructor is given an int above it (a crafted size: building
    even on the meta device takes time and memory growing with them)."""
    path = skeleton.get("class")
    name = ".".join(path) if isinstance(path, list) else repr(path)
    if skeleton.get("rebuildable") is not True:
        raise CheckpointError(
            f"the stage calls a {name} module, which stagewise cannot rebuild from the checkpoint "
            f"({skeleton.get('reason', 'not a torch.nn module')}); load it with the model: compile the "
            "model again and restore the checkpoint into that pipeline"
        )
    cls = torch_nn_class(path)
    arguments = skeleton.get("arguments")
    if not isinstance(arguments, dict):
        raise CheckpointError(f"the skeleton of {name} has no constructor arguments")
    values = {str(k): decode_plain(v, _refuse_other) for k, v in arguments.items()}
    too_large = [k for k, v in values.items() if limit is not None and any(n > limit for n in _ints(v))]
    if too_large:
        raise CheckpointError(f"the skeleton of {name} gives its constructor {too_large[0]}={values[too_large[0]]!r}, "
                              f"more than the {limit} elements of the tensors the stage structure declares for it")
    try:
        with torch.device("meta"):
            module = cls(**values)
    except Exception as error:  # noqa: BLE001 - arguments this PyTorch's class does not take
        raise CheckpointError(f"rebuilding the {name} module from its skeleton failed: {type(error).__name__}: "
                              f"{error}") from None
    module.train(bool(skeleton.get("training", True)))
    return module


def torch_nn_class(path: object) -> type[nn.Module]:
    """The torch.nn class at [module, qualname] if the allowlist names it (codegen/allowlist.py),
    else a CheckpointError: nothing is imported and no attribute is looked up from the name."""
    if not (isinstance(path, list) and len(path) == 2 and all(isinstance(p, str) for p in path)):
        raise CheckpointError(f"a module skeleton names its class as {path!r}, not [module, qualname]")
    found = allowed_leaf(".".join(path))
    if found is None:
        raise CheckpointError(
            f"the checkpoint names the module class {'.'.join(path)}, which is not among the torch.nn modules "
            "stagewise rebuilds (codegen/allowlist.py); load it with the model: compile the model again and "
            "restore the checkpoint into that pipeline"
        )
    return found


def _ints(value: object) -> Iterator[int]:
    """The ints in a decoded constructor argument (a size, or a tuple or dict of them)."""
    if type(value) is int:
        yield value
    elif isinstance(value, list | tuple):
        for item in value:
            yield from _ints(item)
    elif isinstance(value, dict):
        for item in chain(value.keys(), value.values()):
            yield from _ints(item)


def _leaf(fqn: str, skeleton: Any, tensors: Mapping[str, object]) -> nn.Module:
    """The leaf module rebuilt from its skeleton, holding the stage's tensors under its names; no
    constructor argument larger than those tensors' elements (or a small size) is built."""
    own = {name[len(fqn) + 1:]: t for name, t in tensors.items() if name.startswith(fqn + ".") and isinstance(t, torch.Tensor)}
    limit = max(_SMALL_ARGUMENT, sum(t.numel() for t in own.values()))
    try:
        module = rebuild_module(skeleton if isinstance(skeleton, dict) else {}, limit)
    except CheckpointError as error:
        raise CheckpointError(f"the leaf module {fqn}: {error}") from None
    theirs = dict(chain(module.named_parameters(remove_duplicate=False), module.named_buffers(remove_duplicate=False)))
    if set(own) != set(theirs) or any(own[n].shape != theirs[n].shape for n in own):
        raise CheckpointError(f"the stage structure's tensors under {fqn} do not fit the module its skeleton rebuilds")
    for name, tensor in own.items():
        put_tensor(module, name, tensor)
    return module


def describe_leaves(module: fx.GraphModule) -> dict[str, dict]:
    """The skeleton of each torch.nn module the graph calls (call_module) or passes on (get_attr)."""
    leaves = {}
    for node in module.graph.nodes:
        if node.op in ("call_module", "get_attr") and isinstance(attribute(module, node.target), nn.Module):
            leaves[node.target] = describe_module(attribute(module, node.target))
    return leaves


def meta_attributes(tensors: Mapping[str, Any], leaves: Mapping[str, Any]) -> dict[str, object]:
    """Every tensor and leaf module the records describe, by FQN, on the meta device: what
    fx.GraphModule takes to hold the graph's attributes under their names."""
    made: dict[str, object] = dict(meta_tensors(tensors))
    made.update({str(fqn): _leaf(str(fqn), skeleton, made) for fqn, skeleton in leaves.items()})
    return made
