"""In-place operations rewritten out of place, where that provably gives the same values.

`nn.ReLU(inplace=True)`, `x.add_(y)`, `out += identity`, `aten.relu_`: an in-place op on a
value computed in the graph modifies that value for every later reader. Cut into stages, the
value may be a stage's received input (a leaf that requires grad: autograd refuses to modify
it) or a tensor another stage also reads; profiled alone, the layer would modify its synthetic
input. Written out of place, with every later reader of the modified value reading the op's
result instead, the graph says what it computes and each stage owns what it writes.

Only where no alias can tell the difference: the modified value must be produced by an op that
returns a fresh tensor (its ATen schema returns no alias, or a torch.nn module known to), and
no earlier reader may have taken a view of it. Anything else (a view modified in place, a
graph input, a parameter or buffer such as BatchNorm's `num_batches_tracked.add_`) keeps its
in-place op, exactly as eager runs it.
"""

from __future__ import annotations

import copy
import operator

import torch
import torch.fx as fx
from torch import nn
from torch.nn import functional

# torch.nn leaf modules whose output never aliases their input (once not in place).
_FRESH_MODULES: tuple[type[nn.Module], ...] = (
    nn.modules.conv._ConvNd, nn.modules.batchnorm._BatchNorm, nn.modules.instancenorm._InstanceNorm,
    nn.GroupNorm, nn.LayerNorm, nn.Linear, nn.Bilinear, nn.Embedding,
    nn.modules.pooling._MaxPoolNd, nn.modules.pooling._AvgPoolNd, nn.modules.pooling._AdaptiveAvgPoolNd,
    nn.modules.pooling._AdaptiveMaxPoolNd,
    nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.ELU, nn.SELU, nn.CELU, nn.GELU, nn.SiLU, nn.Mish, nn.Hardswish,
    nn.Hardsigmoid, nn.Hardtanh, nn.Sigmoid, nn.Tanh, nn.Softmax, nn.LogSoftmax, nn.Softplus,
)
# Python's in-place operators and their out-of-place forms; on tensors they modify the left operand.
_INPLACE_OPERATORS = {
    operator.iadd: operator.add, operator.isub: operator.sub, operator.imul: operator.mul,
    operator.itruediv: operator.truediv, operator.ifloordiv: operator.floordiv, operator.imod: operator.mod,
    operator.ipow: operator.pow, operator.imatmul: operator.matmul, operator.iand: operator.and_,
    operator.ior: operator.or_, operator.ixor: operator.xor,
}
# ATen names of Python operators, to read their schemas.
_OPERATOR_ATEN = {"truediv": "div", "floordiv": "floor_divide", "mod": "remainder", "and_": "bitwise_and",
                  "or_": "bitwise_or", "xor": "bitwise_xor"}
# namespaces whose builtins fx records as call_function targets (torch.relu_, torch._C._nn.hardswish_)
_NAMESPACES = (torch, torch._C._nn, torch.special)


def functionalize(gm: fx.GraphModule) -> None:
    """Rewrite gm's in-place ops out of place where provably equivalent (module docstring); its code is
    generated again only where that changed the graph (a compile calls this once per size)."""
    order = {node: i for i, node in enumerate(gm.graph.nodes)}
    swapped: set[str] = set()
    rewritten = False
    for node in list(gm.graph.nodes):
        functional = _functional_form(gm, node)
        if functional is None or not _safe(gm, node, order):
            continue
        rewritten = True
        if node.op == "call_module":
            swapped.add(str(node.target))
        elif _inplace_keyword(node):
            node.kwargs = {**node.kwargs, "inplace": False}
        else:
            node.target = functional
        modified = node.args[0]
        for user in list(modified.users):
            if order[user] > order[node]:
                user.replace_input_with(modified, node)
    for target in swapped:
        _swap_out_of_place(gm, target)
    if gm.graph.eliminate_dead_code(lambda n: n.is_impure() or modifies_input(gm, n)) or rewritten:
        gm.recompile()


def modifies_input(gm: fx.GraphModule, node: fx.Node) -> bool:
    """The node writes into one of its inputs: kept by dead-code elimination even when its result
    is unused (fx's own purity check misses `x.relu_()` and `self.relu(x)` with inplace=True)."""
    if node.op == "call_module":
        return getattr(gm.get_submodule(str(node.target)), "inplace", False) is True
    if node.op == "call_method":
        return _writes_an_input(getattr(torch.ops.aten, str(node.target), None))
    target = node.target
    if _inplace_keyword(node):
        return True
    if isinstance(target, torch._ops.OpOverload):
        return any(_writes(a) for a in target._schema.arguments)
    name = getattr(target, "__name__", "")
    return node.op == "call_function" and any(getattr(ns, name, None) is target for ns in _NAMESPACES) \
        and _writes_an_input(getattr(torch.ops.aten, name, None))


def _writes_an_input(packet) -> bool:
    """Some overload writes into its first argument (x.add_(y)); out= overloads write elsewhere."""
    return packet is not None and any(op._schema.arguments and _writes(op._schema.arguments[0])
                                      for op in _overloads(packet))


def _functional_form(gm: fx.GraphModule, node: fx.Node):
    """The out-of-place target of an in-place node (for a module: the target itself); None if not in place."""
    if not node.args or not isinstance(node.args[0], fx.Node):
        return None
    if node.op == "call_module":
        module = gm.get_submodule(str(node.target))
        return node.target if getattr(module, "inplace", False) is True and isinstance(module, _FRESH_MODULES) else None
    if node.op == "call_method":
        name = str(node.target)
        return name[:-1] if _inplace_twin(name) and hasattr(torch.Tensor, name[:-1]) else None
    target = node.target
    if _inplace_keyword(node):
        return target
    if target in _INPLACE_OPERATORS:
        return _INPLACE_OPERATORS[target] if isinstance(node.args[0].meta.get("val"), torch.Tensor) else None
    if isinstance(target, torch._ops.OpOverload):
        return _functional_overload(target)
    name = getattr(target, "__name__", "")
    for namespace in _NAMESPACES:
        if getattr(namespace, name, None) is target and _inplace_twin(name):
            return getattr(namespace, name[:-1], None)
    return None


def _inplace_keyword(node: fx.Node) -> bool:
    """torch.nn.functional.hardswish(x, inplace=True) and the like, kept whole by fx."""
    target = node.target
    return (node.op == "call_function" and node.kwargs.get("inplace") is True
            and getattr(functional, getattr(target, "__name__", ""), None) is target)


def _inplace_twin(name: str) -> bool:
    """`name` is an ATen op that modifies its first argument and every overload of it has an
    out-of-place twin `name[:-1]` with the same arguments (add_ and add; not bernoulli_)."""
    if not name.endswith("_") or name.startswith("_"):
        return False
    inplace, functional = getattr(torch.ops.aten, name, None), getattr(torch.ops.aten, name[:-1], None)
    if inplace is None or functional is None:
        return False
    on_tensors = [op for op in _overloads(inplace) if str(op._schema.arguments[0].type) == "Tensor"]
    return bool(on_tensors) and all(_functional_overload(op) is not None for op in on_tensors)


def _overloads(packet) -> list[torch._ops.OpOverload]:
    return [getattr(packet, o) for o in packet.overloads()]


def _functional_overload(op: torch._ops.OpOverload) -> torch._ops.OpOverload | None:
    """aten.add_.Tensor -> aten.add.Tensor: the same overload out of place, with the same arguments."""
    schema = op._schema
    arguments = schema.arguments
    if not schema.name.endswith("_") or not arguments or not _writes(arguments[0]):
        return None
    if any(_writes(a) for a in arguments[1:]):
        return None
    packet = getattr(torch.ops.aten, schema.name.split("::")[-1][:-1], None)
    twin = getattr(packet, op._overloadname, None) if packet is not None else None
    if twin is None:
        return None
    same = [(a.name, str(a.type)) for a in arguments] == [(a.name, str(a.type)) for a in twin._schema.arguments]
    return twin if same and not _aliases(twin) else None


def _writes(argument) -> bool:
    return argument.alias_info is not None and argument.alias_info.is_write


def _aliases(op: torch._ops.OpOverload) -> bool:
    return any(r.alias_info is not None for r in op._schema.returns)


def _safe(gm: fx.GraphModule, node: fx.Node, order: dict[fx.Node, int]) -> bool:
    """The modified value is a fresh tensor computed in the graph, and none of its readers before
    `node` took an alias of it (which would see the modification in eager)."""
    modified = node.args[0]
    assert isinstance(modified, fx.Node), node  # _functional_form found no in-place op otherwise
    if not isinstance(modified.meta.get("val"), torch.Tensor) or not _fresh(gm, modified):
        return False
    return all(_fresh(gm, user) for user in modified.users if order[user] < order[node])


def _fresh(gm: fx.GraphModule, node: fx.Node) -> bool:
    """What `node` returns aliases none of its inputs."""
    if node.op == "call_module":
        module = gm.get_submodule(str(node.target))
        return isinstance(module, _FRESH_MODULES) and not getattr(module, "inplace", False)
    if node.op not in ("call_function", "call_method"):
        return False
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return not _aliases(target)
    name = target if isinstance(target, str) else getattr(target, "__name__", "")
    if target in _INPLACE_OPERATORS.values():
        name = _OPERATOR_ATEN.get(name, name)
    elif node.op == "call_function" and not any(getattr(ns, name, None) is target
                                                for ns in (*_NAMESPACES, operator, functional)):
        return False
    if node.kwargs.get("inplace") is True:
        return False
    packet = getattr(torch.ops.aten, name, None)
    if packet is None or name.endswith("_"):
        return False
    # out= overloads (mul.out) return the tensor they write into; the others must return no alias
    return not any(_aliases(op) for op in _overloads(packet) if not any(_writes(a) for a in op._schema.arguments))


def _swap_out_of_place(gm: fx.GraphModule, target: str) -> None:
    """Give gm its own copy of an in-place module with inplace=False; the user's model keeps its own."""
    *path, leaf = target.split(".")
    owner: nn.Module = gm
    for part in path:
        private = _container_copy(getattr(owner, part))
        setattr(owner, part, private)  # never set an attribute on a module the user's model holds
        owner = private
    module = copy.copy(getattr(owner, leaf))
    module.inplace = False
    setattr(owner, leaf, module)


def _container_copy(module: nn.Module) -> nn.Module:
    """A plain module holding the same children, parameters and buffers (the tensors shared)."""
    private = nn.Module()
    private.training = module.training  # train() would also set the (shared) children
    private._modules.update(module._modules)
    private._parameters.update(module._parameters)
    private._buffers.update(module._buffers)
    private._non_persistent_buffers_set.update(module._non_persistent_buffers_set)
    return private
