"""A stage module as JSON-able data, and the module rebuilt from it without exec, without pickle,
without importing anything and calling only what an explicit allowlist names.

Why: a checkpoint of generated source and pickles runs code when it is loaded; this one must
not. A stage (a torch.fx.GraphModule our passes cut from a torch.fx or torch.export trace) is
described as data: its graph's nodes in order (op, name, target, args, kwargs: the rebuilt graph
has the same node names, so torch.fx generates the same code), every tensor attribute the graph
reads by FQN (shape, dtype, requires_grad, parameter / buffer / constant, and aliases: one tensor
under two names) and the torch.nn leaves it calls as skeletons (codegen/module_skeleton.py).
Rebuilding resolves every name by exact match (codegen/allowlist.py: ATen ops, listed functions
and classes of torch, operator, math, builtins and stagewise, a tensor's safe methods and
attributes) or from the caller's `trusted` functions, and makes the module on the meta device:
the caller materializes it (`materialize`) and fills its tensors by name (`stage_tensors`).
Saving names any function it can find by name, the user's own included; loading refuses what
is neither listed nor trusted, saying how to trust it.

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

from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

import torch
import torch.fx as fx

from stagewise.codegen import allowlist
from stagewise.codegen.graph_names import callable_name, resolve, trusted_names
from stagewise.codegen.module_skeleton import (
    Encoded,
    decode_plain,
    describe_leaves,
    encode_plain,
    meta_attributes,
)
from stagewise.codegen.stage_tensors import describe_tensors, mark_persistence, materialize, stage_tensors
from stagewise.ir.errors import CheckpointError, PlanError, UntrustedCodeError
from stagewise.ir.subgraph import MODEL_OUTPUT

__all__ = ["FORMAT", "build_stage", "materialize", "stage_structure", "stage_tensors"]

FORMAT = "stagewise.stage/1"
_OPS = ("placeholder", "get_attr", "call_function", "call_module", "call_method", "output")
_CONSTANT_KINDS = {"dtype": torch.dtype, "layout": torch.layout, "memory_format": torch.memory_format}
# torch's dtypes, layouts and memory formats by name: a structure's names are looked up here, not on torch
_TORCH_CONSTANTS = {key: {name: value for name, value in vars(torch).items() if isinstance(value, kind)}
                    for key, kind in _CONSTANT_KINDS.items()}
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

    Names resolve by exact match from `trusted` ({"module.qualname": the function}, for the
    caller's own, e.g. a loss function), else from the allowlist; anything else, or a leaf module
    that is not rebuildable, is a CheckpointError naming the node or module. Then `materialize(module, device)` and copy
    the values into `stage_tensors(module)`: every tensor the graph reads by FQN, constants and
    non-persistent buffers included, once per tied group (the state_dict has neither constants nor
    non-persistent buffers). Constants come back as non-persistent buffers, so that they move."""
    if not isinstance(structure, dict) or structure.get("format") != FORMAT:
        raise CheckpointError(f"not a stage structure of format {FORMAT}: {str(structure)[:80]!r}")
    tensors = _mapping(structure, "tensors")
    attributes = meta_attributes(tensors, _mapping(structure, "modules"))
    graph = _rebuild_graph(structure.get("nodes"), trusted_names(trusted))
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
        record["model_output"] = True  # what pipe.predict returns (compiler/pipeline/prediction.py)
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
        for key, kind in _CONSTANT_KINDS.items():
            if isinstance(value, kind):
                return {key: str(value).removeprefix("torch.")}
        named = callable_name(value)
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


def _rebuild_graph(records: object, trusted: Mapping[str, Callable]) -> fx.Graph:
    """The graph of the node records, each node under its recorded name; a refusal names the node."""
    if not isinstance(records, list):
        raise CheckpointError("a stage structure has no node list")
    graph = fx.Graph()
    nodes: dict[str, fx.Node] = {}
    for record in records:
        name, op = (record.get("name"), record.get("op")) if isinstance(record, dict) else (None, None)
        if op not in _OPS or not isinstance(name, str):
            raise CheckpointError(f"a stage structure holds the node {str(record)[:120]!r}")
        try:
            nodes[name] = _rebuild_node(graph, record, nodes, trusted)
        except CheckpointError as error:
            raise type(error)(f"node {name!r}: {error}") from None  # an UntrustedCodeError stays one
    try:
        graph.lint()
    except RuntimeError as error:
        raise CheckpointError(f"the stage structure's graph is malformed: {error}") from None
    return graph


def _rebuild_node(graph: fx.Graph, record: dict, nodes: dict[str, fx.Node], trusted: Mapping[str, Callable]
                  ) -> fx.Node:
    """One node of the graph, its names resolved by the allowlist and `trusted`."""
    name, op = record["name"], record["op"]
    decode = _decoder(nodes, trusted)
    args = tuple(decode(a) for a in _list(record, "args"))
    kwargs = {_keyword(k): decode(v) for k, v in _list(record, "kwargs")}
    target = _node_target(op, record.get("target"), trusted)
    _check_access(op, target, args)
    node = graph.create_node(op, target, args, kwargs, name=name, type_expr=_annotation(record, trusted))
    if node.name != name:
        raise CheckpointError("the stage structure names two nodes so (or one that is not a name)")
    if record.get("model_output") is True:
        node.meta[MODEL_OUTPUT] = True
    return node


def _node_target(op: str, target: object, trusted: Mapping[str, Callable]) -> Any:
    """A call_function's callable (an op or function), or the name any other node's target is."""
    if op == "call_function":
        if not (isinstance(target, dict) and len(target) == 1 and set(target) <= {"op", "function"}):
            raise CheckpointError(f"it calls {target!r}, which is not an op or a function")
        (key, value), = target.items()
        return resolve(key, value, trusted)
    parts = target.split(".") if isinstance(target, str) else [""]
    if op in ("placeholder", "output"):
        parts = [target.lstrip("*")] if isinstance(target, str) else [""]
    if not all((p.isidentifier() or p.isdigit()) and not p.startswith("__") for p in parts):
        raise CheckpointError(f"its target ({op}) {target!r} is not a plain name")
    return target


def _annotation(record: dict, trusted: Mapping[str, Callable]) -> type | None:
    """A node's type annotation: a listed class (torch.Tensor, int) or one the caller trusts, or none."""
    if "type" not in record:
        return None
    encoded = record["type"]
    path = encoded.get("function") if isinstance(encoded, dict) else None
    name = ".".join(path) if isinstance(path, list) and all(isinstance(p, str) for p in path) else ""
    found = trusted.get(name) or allowlist.allowed_class(name)
    if not isinstance(found, type):
        raise UntrustedCodeError(f"it is annotated with {encoded!r}, which is not among the classes a checkpoint may "
                              "name (torch.Tensor, Python's plain types: codegen/allowlist.py)")
    return found


def _keyword(key: object) -> str:
    """A keyword argument's name, which torch.fx writes into the code as it is: an identifier."""
    if not (isinstance(key, str) and key.isidentifier()):
        raise CheckpointError(f"it has the keyword argument {key!r}, which is not a name")
    return key


def _check_access(op: str, target: object, args: tuple) -> None:
    """A method called or an attribute read (`x.view(...)`, `getattr(x, "shape")`) is one of a
    tensor's that reach no storage, file, hook or code (codegen/allowlist.py): `getattr(x,
    "__class__")`, `x.untyped_storage()` and their like reach anything."""
    if op == "call_method":
        attribute = target
    elif target is getattr:
        attribute = args[1] if len(args) > 1 else None
    else:
        return
    if not (isinstance(attribute, str) and allowlist.allowed_attribute(attribute)):
        raise CheckpointError(f"it reads the attribute {attribute!r} of a value, which a checkpoint may not (only "
                              "a tensor's public methods and attributes that reach no storage, file or hook)")


def _decoder(nodes: dict[str, fx.Node], trusted: Mapping[str, Callable]) -> Callable[[Encoded], Any]:
    """Decodes a node's arguments, referring to the nodes before it."""

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
        if key in _TORCH_CONSTANTS and isinstance(value, str) and value in _TORCH_CONSTANTS[key]:
            return _TORCH_CONSTANTS[key][value]
        if key == "function" and isinstance(value, list) and value[:1] in (["builtins"], ["operator"], ["_operator"]):
            raise CheckpointError(f"it passes {'.'.join(map(str, value))} on as a value, which a checkpoint may not "
                                  "(a function taking it could reach any attribute)")
        if key in ("op", "function", "enum"):
            return resolve(key, value, trusted)
        raise CheckpointError(f"it holds {{{key!r}: {value!r}}}, which names no value (or a later node)")

    def decode(data: Encoded) -> Any:
        return decode_plain(data, other)

    return decode


def _mapping(structure: dict, key: str) -> dict:
    """structure[key], which must be a mapping: a damaged structure is a CheckpointError, not a crash."""
    value = structure.get(key)
    if not isinstance(value, dict):
        raise CheckpointError(f"a stage structure has no {key!r} mapping")
    return value


def _list(record: dict, key: str) -> list:
    """record[key], which must be a list (args, kwargs pairs)."""
    value = record.get(key, [])
    if not isinstance(value, list):
        raise CheckpointError(f"its {key} {value!r} is not a list")
    return value
