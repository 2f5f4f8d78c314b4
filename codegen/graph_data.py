"""A stage module as JSON-able data, and the module rebuilt from it without exec, without pickle
and without importing anything outside an allowlist.

Why: a checkpoint of generated source and pickles runs code when it is loaded; this one must
not. A stage (a torch.fx.GraphModule our passes cut from a torch.fx or torch.export trace) is
described as data: its graph's nodes in order (op, name, target, args, kwargs: the rebuilt graph
has the same node names, so torch.fx generates the same code), every tensor attribute the graph
reads by FQN (shape, dtype, requires_grad, parameter / buffer / constant, and aliases: one tensor
under two names) and the torch.nn leaves it calls as skeletons (codegen/module_skeleton.py).
Rebuilding resolves every call target by name from an allowlist (ATen and other registered ops
through `torch.ops`, functions of torch, operator, math, stagewise and a safe subset of
builtins) or from the caller's `trusted` functions, and makes the module on the meta device: the
caller materializes it (`materialize`) and fills its tensors by name (`stage_tensors`).

    {"format": "stagewise.stage/1", "training": true,
     "nodes": [{"op": "placeholder", "name": "x", "target": "x", "args": [], "kwargs": []},
               {"op": "call_function", "name": "mm", "target": {"op": "aten.mm.default"},
                "args": [{"node": "x"}, {"node": "w"}], "kwargs": []}, ...],
     "tensors": {"w": {"kind": "parameter", "shape": [4, 4], "dtype": "float32", "requires_grad": true},
                 "head.weight": {"kind": "parameter", "alias_of": "tok.weight"}, ...},
     "modules": {"tok": {"class": ["torch.nn.modules.sparse", "Embedding"], "arguments": {...}, ...}}}

kwargs are [name, value] pairs and dicts {"dict": [[k, v], ...]}: their order is part of the
generated code, and an object's keys would be reordered by `json.dumps(sort_keys=True)`.
"""

from __future__ import annotations

import enum
import importlib
import sys
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

import torch
import torch.fx as fx

from stagewise.codegen.module_skeleton import (
    Encoded,
    decode_plain,
    describe_leaves,
    encode_plain,
    meta_attributes,
)
from stagewise.codegen.stage_tensors import describe_tensors, mark_persistence, materialize, stage_tensors
from stagewise.ir.errors import CheckpointError, PlanError
from stagewise.ir.subgraph import MODEL_OUTPUT

__all__ = ["FORMAT", "build_stage", "materialize", "resolve_function", "stage_structure", "stage_tensors"]

FORMAT = "stagewise.stage/1"
_OPS = ("placeholder", "get_attr", "call_function", "call_module", "call_method", "output")
_TORCH_CONSTANTS = {"dtype": torch.dtype, "layout": torch.layout, "memory_format": torch.memory_format}
_SAFE_BUILTINS = frozenset({"getattr", "len", "range", "slice", "int", "float", "bool", "tuple", "list", "dict",
                            "min", "max", "abs", "isinstance"})
_UNSAFE_OPERATOR = frozenset({"call", "attrgetter", "itemgetter", "methodcaller"})  # reach any attribute or call
# torch modules that load, compile or run code from files, strings or the network
_UNSAFE_TORCH = ("torch.hub", "torch.package", "torch.serialization", "torch.jit", "torch.utils.cpp_extension",
                 "torch._dynamo", "torch._inductor", "torch.compiler", "torch.multiprocessing", "torch.library",
                 "torch.export", "torch._export", "torch.fx.graph_module", "torch.distributed.checkpoint")
_UNSAFE_WORDS = ("load", "save", "import", "compile", "exec", "eval", "system", "spawn", "open", "file", "dump",
                 "pickle")
_NO_TRUSTED: Mapping[str, Callable] = MappingProxyType({})


def stage_structure(module: fx.GraphModule) -> dict:
    """`module` as JSON-serializable data (module docstring); the same module gives the same data.
    A PlanError names a node holding a value the data cannot describe (a lambda, a tensor subclass)."""
    if type(module.graph._codegen) is not fx.graph.CodeGen:
        raise PlanError(f"{type(module).__name__} generates its code with {type(module.graph._codegen).__name__}; "
                        "only torch.fx's plain CodeGen can be described as data")
    return {"format": FORMAT, "training": module.training,
            "nodes": [_describe_node(node) for node in module.graph.nodes],
            "tensors": describe_tensors(module), "modules": describe_leaves(module)}


def build_stage(structure: dict, class_name: str, trusted: Mapping[str, Callable] = _NO_TRUSTED) -> fx.GraphModule:
    """The stage `stage_structure` described, on the meta device (parameters and buffers empty, of
    their shapes, dtypes and requires_grad, aliases tied, leaves rebuilt from their skeletons).

    Call targets resolve by name from the allowlist, else from `trusted` ({"module.qualname": the
    function}, for the caller's own, e.g. a loss function); anything else, or a leaf module that is
    not rebuildable, is a CheckpointError naming it. Then `materialize(module, device)` and copy
    the values into `stage_tensors(module)`: every tensor the graph reads by FQN, constants and
    non-persistent buffers included, once per tied group (the state_dict has neither constants nor
    non-persistent buffers). Constants come back as non-persistent buffers, so that they move."""
    if not isinstance(structure, dict) or structure.get("format") != FORMAT:
        raise CheckpointError(f"not a stage structure of format {FORMAT}: {str(structure)[:80]!r}")
    tensors = _mapping(structure, "tensors")
    attributes = meta_attributes(tensors, _mapping(structure, "modules"))
    graph = _rebuild_graph(structure.get("nodes"), trusted)
    try:
        module = fx.GraphModule(attributes, graph, class_name=class_name)
    except KeyError as missing:
        raise CheckpointError(f"the stage graph reads {missing}, which its structure does not describe") from None
    except Exception as error:  # noqa: BLE001 - torch.fx could not generate code for the graph
        raise CheckpointError(f"the stage structure's graph gives no module: {type(error).__name__}: {error}") from None
    mark_persistence(module, tensors)
    module.training = bool(structure.get("training", True))
    return module


def _describe_node(node: fx.Node) -> dict:
    """One node as data: a call_function's target by name, every other target as the name it is."""
    encode = _encoder(node)
    if node.op == "call_function":
        target = encode(node.target)
    elif isinstance(node.target, str):
        target = node.target
    else:
        raise PlanError(f"node {node.name!r} ({node.op}) has the target {node.target!r}, not a name")
    record = {"op": node.op, "name": node.name, "target": target, "args": [encode(a) for a in node.args],
              "kwargs": [[key, encode(value)] for key, value in node.kwargs.items()]}
    if node.type is not None:
        record["type"] = encode(node.type)
    if node.meta.get(MODEL_OUTPUT):
        record["model_output"] = True  # what pipe.predict returns (compiler/prediction.py)
    return record


def _encoder(node: fx.Node) -> Callable[[object], Encoded]:
    """Encodes `node`'s arguments; a PlanError names the node and a value it cannot describe."""

    def other(value: object) -> Encoded:
        if isinstance(value, fx.Node):
            return {"node": value.name}
        if isinstance(value, slice):
            return {"slice": [encode(value.start), encode(value.stop), encode(value.step)]}
        if value is Ellipsis:
            return {"ellipsis": True}
        if isinstance(value, torch.Size) and all(type(s) is int for s in value):
            return {"size": list(value)}
        if isinstance(value, torch.device):
            return {"device": str(value)}
        for key, kind in _TORCH_CONSTANTS.items():
            if isinstance(value, kind):
                return {key: str(value).removeprefix("torch.")}
        named = _callable_name(value)
        if named is not None:
            return named
        raise PlanError(
            f"node {node.name!r} ({node.format_node()}) holds {value!r} (a {type(value).__qualname__}), which a "
            "stage structure cannot describe: only nodes, None, bool, int, float, str, containers, slices, torch "
            "dtypes, devices, layouts, memory formats, sizes, ops and module-level functions"
        )

    def encode(value: object) -> Encoded:
        return encode_plain(value, other)

    return encode


def _callable_name(value: object) -> dict | None:
    """{"op": "aten.mm.default"}, {"function": [module, qualname]} or {"enum": [module, qualname, member]}
    where looking the name up gives `value` back; None where none does."""
    if isinstance(value, torch._ops.OpOverload):
        path = f"{value.namespace}.{value._opname}.{value._overloadname}"
    elif isinstance(value, torch._ops.OpOverloadPacket):
        path = value._qualified_op_name.replace("::", ".")
    elif isinstance(value, torch._ops.OperatorBase):
        return None  # a higher-order op: it takes graphs
    elif isinstance(value, enum.Enum):
        cls = _function_path(type(value))
        return None if cls is None else {"enum": [*cls, value.name]}
    else:
        found = _function_path(value) if callable(value) else None
        return None if found is None else {"function": found}
    try:
        return {"op": path} if _resolve_op(path) is value else None
    except CheckpointError:
        return None


def _function_path(value: object) -> list[str] | None:
    """[module, qualname] of a module-level function or class, found by looking it up (no import)."""
    module = getattr(value, "__module__", None) or getattr(getattr(value, "__objclass__", None), "__module__", None)
    if not isinstance(module, str):
        return None
    for name in (getattr(value, "__qualname__", None), getattr(value, "__name__", None)):
        if isinstance(name, str) and "<" not in name and _lookup(module, name, importing=False) is value:
            return [module, name]
    return None


def _lookup(module_name: str, qualname: str, importing: bool) -> object:
    """module_name.qualname from the modules already imported (or importing it), else None."""
    first, *rest = module_name.split(".")
    found = sys.modules.get(module_name) or _walk(sys.modules.get(first), rest)
    if found is None and importing:
        found = importlib.import_module(module_name)
    return _walk(found, qualname.split("."))


def _walk(obj: object, parts: list[str]) -> object:
    """obj.a.b for parts [a, b], None where an attribute is missing (nothing raised while describing)."""
    for part in parts:
        obj = getattr(obj, part, None) if obj is not None else None
    return obj


def _resolve(key: str, value: Encoded, trusted: Mapping[str, Callable]) -> object:
    """An op, function, class or enum member named by the data."""
    if key == "op":
        return _resolve_op(value)
    if not (isinstance(value, list) and len(value) == (3 if key == "enum" else 2) and all(isinstance(v, str) for v in value)):
        raise CheckpointError(f"a stage structure names a {key} as {value!r}")
    function = resolve_function(value[0], value[1], trusted)
    if key == "function":
        return function
    if not (isinstance(function, type) and issubclass(function, enum.Enum) and value[2] in function.__members__):
        raise CheckpointError(f"{value[0]}.{value[1]} has no member {value[2]!r}")
    return function[value[2]]


def _resolve_op(path: object) -> object:
    """torch.ops.<namespace>.<op>[.<overload>] by attribute lookups on torch.ops (no import)."""
    parts = path.split(".") if isinstance(path, str) else []
    # an op may be named like a dunder (aten.__and__); the namespace and the overload may not
    if (len(parts) not in (2, 3) or not all(p.isidentifier() for p in parts)
            or any(p.startswith("__") for p in parts[::2])):
        raise CheckpointError(f"a stage structure names the op {path!r}, not namespace.op.overload")
    try:
        namespace = getattr(torch.ops, parts[0])
        packet = getattr(namespace, parts[1]) if isinstance(namespace, torch._ops._OpNamespace) else None
        op = packet if len(parts) == 2 or packet is None else getattr(packet, parts[2])
    except (AttributeError, RuntimeError):
        op = None
    kind = torch._ops.OpOverloadPacket if len(parts) == 2 else torch._ops.OpOverload
    if not isinstance(op, kind):
        raise CheckpointError(f"the stage calls the op torch.ops.{path}, which this PyTorch has not registered "
                              "(an op of a library: import the library that defines it before loading)")
    return op


def resolve_function(module_name: str, qualname: str, trusted: Mapping[str, Callable] = _NO_TRUSTED) -> Callable:
    """A function or class by name: from `trusted` ({"module.qualname": it}), else from the allowlist
    (torch and stagewise, operator, math, a safe subset of builtins), else a CheckpointError."""
    name = f"{module_name}.{qualname}"
    if name in trusted:
        return trusted[name]
    refusal = _refusal(module_name, qualname)
    if refusal is None:
        try:
            found = _lookup(module_name, qualname, importing=True)
        except ImportError:
            found = None
        if callable(found):
            return found
        refusal = "does not exist in this environment"
    raise CheckpointError(
        f"the stage calls {name}, which {refusal}: a checkpoint runs only torch and stagewise functions and "
        f"ops; if it is your own function, pass it to the load as trusted={{{name!r}: {qualname.rsplit('.', 1)[-1]}}}"
    )


def _refusal(module_name: str, qualname: str) -> str | None:
    """Why the allowlist refuses module_name.qualname, or None."""
    parts = module_name.split(".") + qualname.split(".")
    if not all(p.isidentifier() and not p.startswith("__") for p in parts):
        return "is not a plain name"
    if module_name in ("operator", "_operator"):
        return "may call anything" if qualname in _UNSAFE_OPERATOR else None
    if module_name == "math":
        return None
    if module_name == "builtins":
        return None if qualname in _SAFE_BUILTINS else "is not among the safe builtins"
    if parts[0] not in ("torch", "stagewise"):
        return "is not on the allowlist"
    if any(module_name == m or module_name.startswith(m + ".") for m in _UNSAFE_TORCH) or \
            any(word in parts[-1].lower() for word in _UNSAFE_WORDS):
        return "may load or run other code"
    return None


def _rebuild_graph(records: object, trusted: Mapping[str, Callable]) -> fx.Graph:
    """The graph of the node records, each node under its recorded name."""
    if not isinstance(records, list):
        raise CheckpointError("a stage structure has no node list")
    graph = fx.Graph()
    nodes: dict[str, fx.Node] = {}
    for record in records:
        name, op = (record.get("name"), record.get("op")) if isinstance(record, dict) else (None, None)
        if op not in _OPS or not isinstance(name, str):
            raise CheckpointError(f"a stage structure holds the node {str(record)[:120]!r}")
        decode = _decoder(nodes, trusted, name)
        args = tuple(decode(a) for a in _list(record, "args", name))
        kwargs = {_keyword(k, name): decode(v) for k, v in _list(record, "kwargs", name)}
        target = _node_target(op, record.get("target"), trusted, name)
        _check_access(op, target, args, name)
        type_expr = _annotation(record, trusted)
        node = graph.create_node(op, target, args, kwargs, name=name, type_expr=type_expr)
        if node.name != name:
            raise CheckpointError(f"the stage structure names two nodes {name!r} (or one that is not a name)")
        if record.get("model_output") is True:
            node.meta[MODEL_OUTPUT] = True
        nodes[name] = node
    try:
        graph.lint()
    except RuntimeError as error:
        raise CheckpointError(f"the stage structure's graph is malformed: {error}") from None
    return graph


def _node_target(op: str, target: object, trusted: Mapping[str, Callable], name: str) -> Any:
    """A call_function's callable (an op or function), or the name any other node's target is."""
    if op == "call_function":
        if not (isinstance(target, dict) and len(target) == 1 and set(target) <= {"op", "function"}):
            raise CheckpointError(f"node {name!r} calls {target!r}, which is not an op or a function")
        (key, value), = target.items()
        return _resolve(key, value, trusted)
    parts = target.split(".") if isinstance(target, str) else [""]
    if op in ("placeholder", "output"):
        parts = [target.lstrip("*")] if isinstance(target, str) else [""]
    if not all((p.isidentifier() or p.isdigit()) and not p.startswith("__") for p in parts):
        raise CheckpointError(f"node {name!r} ({op}) has the target {target!r}, which is not a plain name")
    return target


def _annotation(record: dict, trusted: Mapping[str, Callable]) -> type | None:
    """A node's type annotation: a class named as a function is (torch.Tensor, int), or none."""
    if "type" not in record:
        return None
    encoded = record["type"]
    found = _resolve("function", encoded.get("function"), trusted) if isinstance(encoded, dict) else None
    if not isinstance(found, type):
        raise CheckpointError(f"node {record.get('name')!r} is annotated with {encoded!r}, which names no class")
    return found


def _keyword(key: object, name: str) -> str:
    """A keyword argument's name, which torch.fx writes into the code as it is: an identifier."""
    if not (isinstance(key, str) and key.isidentifier()):
        raise CheckpointError(f"node {name!r} has the keyword argument {key!r}, which is not a name")
    return key


def _check_access(op: str, target: object, args: tuple, name: str) -> None:
    """No dunder attribute or method (`getattr(x, "__class__")` and its like reach any code), and no
    method named as one that loads, saves or runs something (`tofile`, `dump`)."""
    attribute = target if op == "call_method" else args[1] if target is getattr and len(args) > 1 else ""
    if not isinstance(attribute, str) or attribute.startswith("__") or \
            (op == "call_method" and any(word in attribute.lower() for word in _UNSAFE_WORDS)):
        raise CheckpointError(f"node {name!r} reads the attribute {attribute!r} of a value, which a checkpoint may not")


def _decoder(nodes: dict[str, fx.Node], trusted: Mapping[str, Callable], name: str) -> Callable[[Encoded], Any]:
    """Decodes node `name`'s arguments, referring to the nodes before it."""

    def other(key: str, value: Encoded) -> object:
        if key == "node" and value in nodes:
            return nodes[value]
        if key == "slice" and isinstance(value, list) and len(value) == 3:
            return slice(*(decode(v) for v in value))
        if key == "ellipsis":
            return ...
        if key == "size" and isinstance(value, list) and all(type(s) is int for s in value):
            return torch.Size(value)
        if key == "device" and isinstance(value, str):
            try:
                return torch.device(value)
            except RuntimeError:
                pass
        if key in _TORCH_CONSTANTS and isinstance(value, str) and value.isidentifier():
            found = getattr(torch, value, None)
            if isinstance(found, _TORCH_CONSTANTS[key]):
                return found
        if key == "function" and isinstance(value, list) and value[:1] in (["builtins"], ["operator"], ["_operator"]):
            raise CheckpointError(f"node {name!r} passes {'.'.join(map(str, value))} on as a value, which a "
                                  "checkpoint may not (a function taking it could reach any attribute)")
        if key in ("op", "function", "enum"):
            return _resolve(key, value, trusted)
        raise CheckpointError(f"node {name!r} holds {{{key!r}: {value!r}}}, which names no value (or a later node)")

    def decode(data: Encoded) -> Any:
        return decode_plain(data, other)

    return decode


def _mapping(structure: dict, key: str) -> dict:
    """structure[key], which must be a mapping: a damaged structure is a CheckpointError, not a crash."""
    value = structure.get(key)
    if not isinstance(value, dict):
        raise CheckpointError(f"a stage structure has no {key!r} mapping")
    return value


def _list(record: dict, key: str, name: str) -> list:
    """record[key], which must be a list (args, kwargs pairs)."""
    value = record.get(key, [])
    if not isinstance(value, list):
        raise CheckpointError(f"node {name!r} has {key} {value!r}, not a list")
    return value
