"""Node values and forward FLOPs at one microbatch size: node.meta['val'] and ['flops'].

An fx graph gets them by fake-tensor propagation (`annotate`), a torch.nn leaf module repeated
with the same configuration and input shapes run only once; a node of an exported graph whose
values were evaluated at a size (stagewise.passes.symbolic_sizes) gets its FLOPs from
torch.utils.flop_counter's formulas on those shapes (`op_flops`).
"""

from __future__ import annotations

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.node import map_arg
from torch.fx.passes.fake_tensor_prop import FakeTensorProp
from torch.utils._pytree import tree_map
from torch.utils.flop_counter import FlopCounterMode, flop_registry

from stagewise.ir.errors import LossError
from stagewise.ir.subgraph import attribute
from stagewise.passes.symbolic_sizes import Unsupported


def annotate(gm: fx.GraphModule, example_inputs, example_target) -> None:
    """Fill node.meta['val'] (fake tensors) and node.meta['flops'] (forward FLOPs) for one microbatch."""
    inputs = list(example_inputs.values()) if isinstance(example_inputs, dict) else list(example_inputs)
    if example_target is not None and any(n.target == "target" or n.target == "loss_target" for n in gm.graph.nodes if n.op == "placeholder"):
        inputs.append(example_target)
    _CountingProp(gm, FakeTensorMode(allow_non_fake_inputs=True)).propagate(*inputs)


class _CountingProp(FakeTensorProp):
    """Fake-tensor shape propagation that also counts each node's forward FLOPs.

    A torch.nn leaf module (no children, no hooks) gives the same output shapes and FLOPs for the
    same configuration, state shapes and input shapes: repeated blocks (a chain of 1000
    Linear + ReLU, a ResNet's stages) are run once each and the rest take fresh fake tensors of
    the remembered shapes.
    """

    def __init__(self, module: fx.GraphModule, mode: FakeTensorMode):
        super().__init__(module, mode)
        self.memo: dict[str, tuple] = {}

    def run_node(self, n: fx.Node):
        if n.op not in ("call_function", "call_method", "call_module"):
            n.meta["flops"] = 0
            return super().run_node(n)
        key = self._module_key(n) if n.op == "call_module" else None
        if key is not None and key in self.memo:
            like, flops = self.memo[key]
            result = tree_map(lambda v: torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=v.device)
                              if isinstance(v, torch.Tensor) else v, like)
            n.meta["val"], n.meta["flops"] = result, flops
            return result
        counter = FlopCounterMode(display=False)
        with counter:
            result = super().run_node(n)
        n.meta["flops"] = int(counter.get_total_flops())
        if key is not None:
            self.memo[key] = (n.meta.get("val"), n.meta["flops"])
        return result

    def _module_key(self, n: fx.Node) -> str | None:
        module = self.module.get_submodule(str(n.target))
        if (next(module.children(), None) is not None or module._forward_hooks or module._forward_pre_hooks
                or not type(module).__module__.startswith("torch.nn")):
            return None
        config = sorted((k, v) for k, v in vars(module).items()
                        if isinstance(v, int | float | bool | str | torch.dtype | torch.device | tuple | None))
        state = [(k, tuple(t.shape), t.dtype, t.requires_grad) for k, t in
                 [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]]
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        return repr((type(module).__qualname__, config, state, tree_map(_shape_key, (args, kwargs))))


def op_flops(template: fx.GraphModule, node: fx.Node, mode: FakeTensorMode, memo: dict[str, int]) -> int:
    """Forward FLOPs of one ATen node at its values' sizes, as FlopCounterMode counts them: an op
    with a formula by the formula, a composite op (linear, matmul, attention) by running its
    decomposition on fake tensors (once per op and argument shapes: repeated blocks hit the
    memo), any other op 0."""
    if node.op in ("placeholder", "get_attr", "output"):
        return 0
    op = node.target
    if node.op != "call_function" or isinstance(op, torch._ops.HigherOrderOperator):
        raise Unsupported(f"{node.op} {op}")
    if not isinstance(op, torch._ops.OpOverload):
        return 0  # operator.getitem and the like
    args, kwargs = map_arg((node.args, node.kwargs), lambda n: n.meta["val"] if "val" in n.meta
                           else attribute(template, str(n.target)))
    if op.overloadpacket in flop_registry:
        return int(flop_registry[op.overloadpacket](*args, **kwargs, out_val=node.meta["val"]))
    if not op.has_kernel_for_dispatch_key(torch._C.DispatchKey.CompositeImplicitAutograd):
        return 0
    key = repr((op, tree_map(_shape_key, (args, kwargs))))
    if key not in memo:
        counter = FlopCounterMode(display=False)
        with mode, counter:
            op(*args, **kwargs)
        memo[key] = int(counter.get_total_flops())
    return memo[key]


def _shape_key(value):
    """What an op's FLOPs can depend on: a tensor's shape, strides and dtype; any other value itself."""
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), tuple(value.stride()), value.dtype, value.device)
    return value


def check_loss(gm: fx.GraphModule) -> None:
    """The graph's output is a scalar floating-point loss, else a LossError saying what to pass."""
    (output,) = [n for n in gm.graph.nodes if n.op == "output"]
    value = output.args[0].meta.get("val") if isinstance(output.args[0], fx.Node) else output.args[0]
    if not isinstance(value, torch.Tensor) or value.numel() != 1 or not value.is_floating_point():
        shape = list(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        raise LossError(
            f"the model's output has shape {shape} (for one microbatch), not a scalar loss: pass loss_fn=(output, target) -> loss "
            "and example_target=, or make the model return its loss"
        )
