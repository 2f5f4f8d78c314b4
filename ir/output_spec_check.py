"""A plan's record of the model output's structure (pytree JSON, what `pipe.predict` rebuilds),
checked before torch reads it.

Why: torch's `treespec_loads` imports a module named in the JSON it reads: a `defaultdict` node's
context names its default factory by module and name, and every context is parsed with a hook that
turns `{"__enum__": ..., "fqn": "module:Class"}` into that class's member after importing the
module. plan.json is untrusted (an attacker rewrites it, marker included), and an import runs the
module, a file placed beside the checkpoint included. So the structure may name only types this
process registered with torch's pytree whose context is plain data (every registered type but
those with a deserializer of their own, except the namedtuple's, which only looks its type up),
its contexts hold no `__enum__` object, and its size and depth are bounded.
"""

from __future__ import annotations

import json
from typing import NoReturn

from torch.utils import _pytree as pytree

from stagewise.ir.declared import ALTERED
from stagewise.ir.errors import CheckpointError

_LOOKUP_ONLY = "collections.namedtuple"  # its deserializer reads a registered type by name, nothing else
_MAX_NODES = 1 << 14
_MAX_DEPTH = 64
_WHERE = "plan.json output_spec"


def check_output_spec(described: object) -> None:
    """A CheckpointError unless `described` is pytree JSON torch can read without importing anything."""
    if described is None:
        return
    try:
        protocol, schema = json.loads(described) if isinstance(described, str) else (None, None)
    except (ValueError, TypeError, RecursionError):
        protocol, schema = None, None
    if type(protocol) is not int:
        _refuse("is not pytree JSON ([protocol, structure])")
    budget = [_MAX_NODES]
    _check_node(schema, 0, budget)


def _check_node(node: object, depth: int, budget: list[int]) -> None:
    """One node of the structure and, within the bounds, its children."""
    budget[0] -= 1
    if depth > _MAX_DEPTH or budget[0] < 0:
        _refuse(f"nests deeper than {_MAX_DEPTH} or holds more than {_MAX_NODES} nodes")
    if not (isinstance(node, dict) and set(node) == {"type", "context", "children_spec"}):
        _refuse(f"holds the node {str(node)[:80]!r}, not {{type, context, children_spec}}")
    kind, context, children = node["type"], node["context"], node["children_spec"]
    if kind is not None:
        registered = pytree.SERIALIZED_TYPE_TO_PYTHON_TYPE.get(kind) if isinstance(kind, str) else None
        if registered is None:
            _refuse(f"names the type {str(kind)[:80]!r}, which no module of this process registered with torch's "
                    "pytree (for a Hugging Face output: import its transformers class before loading)")
        own_reader = pytree.SUPPORTED_SERIALIZED_TYPES[registered].from_dumpable_context
        if own_reader is not None and kind != _LOOKUP_ONLY:
            _refuse(f"names the type {kind!r}, whose context torch reads by importing what it names")
    if context is not None:
        if not isinstance(context, str):
            _refuse(f"holds the context {str(context)[:80]!r}, not JSON text")
        try:
            _check_plain(_parsed(context))
        except RecursionError:
            _refuse("holds a context nested deeper than Python reads")
    if not isinstance(children, list):
        _refuse(f"holds the children {str(children)[:80]!r}, not a list")
    for child in children:
        _check_node(child, depth + 1, budget)


def _parsed(context: str) -> object:
    try:
        return json.loads(context)
    except ValueError:
        _refuse(f"holds the context {context[:80]!r}, which is not JSON")


def _check_plain(value: object) -> None:
    """No object in a context asks torch's reader to import a module (`__enum__`)."""
    if isinstance(value, dict):
        if "__enum__" in value:
            _refuse(f"holds {str(value)[:80]!r}, which torch's reader would import a module for")
        for item in value.values():
            _check_plain(item)
    elif isinstance(value, list):
        for item in value:
            _check_plain(item)


def _refuse(why: str) -> NoReturn:
    raise CheckpointError(f"{_WHERE} {why}; {ALTERED}")
