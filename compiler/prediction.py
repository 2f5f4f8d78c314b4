"""`pipe.predict`: the model's output (the loss function's first argument, or the `.logits` of a model
returning its own loss, marked at capture) of a forward-only pass in eval mode, through the evaluation's executor (compiler/evaluation.py).

Each stage that computes the marked value runs a copy of its graph that also returns it, and each
last stage a copy that returns a zero instead of the loss, with what only the loss needed left out,
so no target is fed. The copies share the stage's parameters, buffers and leaves; the stages' own
modules are back in place afterwards, so training programs and code are untouched. Under
torch.distributed every rank calls it (as `evaluate`): the ranks holding the output send it to
every rank, which returns the whole batch's.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.fx as fx

from stagewise.compiler.evaluation import Evaluation
from stagewise.ir.errors import PredictError
from stagewise.ir.plan import Plan
from stagewise.ir.subgraph import MODEL_OUTPUT
from stagewise.runtime.distributed import DistributedTransport
from stagewise.runtime.executor import StreamExecutor

UNKNOWN = ("pipe.predict needs the model's output as a value of the traced graph: it is known for a model "
           "compiled (or saved and loaded) whose forward returns one tensor (loss_fn's first argument) or an "
           "object with .logits beside its own .loss; this model returns neither. Compile it with "
           "loss_fn=(output, target) -> loss, or run the model eagerly to predict")


def predict(evaluation: Evaluation, microbatches: int, feed, training_executor: StreamExecutor) -> torch.Tensor:
    """The model's outputs of every microbatch, concatenated along dim 0, on the CPU."""
    copies = [_predict_module(w.module, w.is_last) for w in evaluation.workers]
    distributed = isinstance(evaluation.transport, DistributedTransport)
    if not distributed and not any(holds for _, holds in copies):
        raise PredictError(UNKNOWN)
    originals = [w.module for w in evaluation.workers]
    holders = [w for w, (_, holds) in zip(evaluation.workers, copies, strict=True) if holds]

    def collect() -> dict[int, torch.Tensor]:
        return {mb: out[-1].detach().cpu() for w in holders for mb, out in w.outputs.items()}

    for worker, (module, _) in zip(evaluation.workers, copies, strict=True):
        worker.module = module
    try:
        _, pieces = evaluation.forward_pass(microbatches, feed, training_executor, collect)
    finally:
        for worker, module in zip(evaluation.workers, originals, strict=True):
            worker.module = module
    if distributed:
        pieces = _gathered(pieces)
    return torch.cat([pieces[mb] for mb in range(microbatches)])


def fill_unread_inputs(plan: Plan, modules: Sequence[fx.GraphModule | None], kwargs: dict) -> dict:
    """`kwargs` with each keyword input predict does not read (labels, which only the loss took) that
    the caller left out filled in: zeros like a given input the example shaped alike (input_ids for
    labels), so `pipe.predict(input_ids=ids)` works for a model that computes its own loss."""
    if plan.input_kind != "keyword" or not kwargs:
        return kwargs
    unread = _unread_inputs(plan, modules)
    specs = dict(zip(plan.input_names, plan.input_specs, strict=False))
    filled = dict(kwargs)
    for name in plan.input_names:
        if name in kwargs or name not in unread:
            continue
        like = next((given for given, value in kwargs.items()
                     if specs.get(given) == specs[name] and isinstance(value, torch.Tensor)), None)
        if like is not None:
            filled[name] = torch.zeros_like(kwargs[like])
    return filled


def _unread_inputs(plan: Plan, modules: Sequence[fx.GraphModule | None]) -> set[str]:
    """The inputs (by the model's names) no stage's predict module reads; none when a module is unknown."""
    last = max(stage.position for stage in plan.stages)
    read: set[str] = set()
    for stage, module in zip(plan.stages, modules, strict=True):
        if module is None:
            return set()
        copy, _ = _predict_module(module, stage.position == last)
        read |= {str(n.target) for n in copy.graph.nodes
                 if n.op == "placeholder" and any(not _reads_metadata(user) for user in n.users)}
    user_names = dict(zip(plan.graph_inputs, plan.input_names, strict=False))
    return {user_names[g] for g in plan.graph_inputs if g in user_names and g not in read}


_ASSERT_METADATA = torch.ops.aten._assert_tensor_metadata.default
_METADATA_OPS = {torch.ops.aten.sym_size.int, torch.ops.aten.sym_numel.default, torch.ops.aten.sym_stride.int,
                 torch.ops.aten._assert_tensor_metadata.default, getattr}  # sizes, dtype, device: no values


def _reads_metadata(node: fx.Node) -> bool:
    """Whether `node` reads only a tensor's sizes, dtype or device (a zero-filled stand-in of the same
    shape gives it the same answer), not its values."""
    return node.op == "call_function" and node.target in _METADATA_OPS


def _gathered(pieces: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
    """Every rank's outputs by microbatch, on every rank (each rank computed those of its stages);
    PredictError on every rank when no rank knows the model's output."""
    parts: list[dict[int, torch.Tensor] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, pieces)
    merged = {mb: out for part in parts for mb, out in (part or {}).items()}
    if not merged:
        raise PredictError(UNKNOWN)
    return merged


def _predict_module(module: fx.GraphModule, last: bool) -> tuple[fx.GraphModule, bool]:
    """The stage's module for predict, and whether it returns the model's output (last)."""
    marked = [n for n in module.graph.nodes if n.op != "placeholder" and n.meta.get(MODEL_OUTPUT)]
    if not marked and not last:
        return module, False
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    outputs = list(graph.graph_copy(module.graph, env))
    if last:
        outputs[0] = graph.call_function(torch.zeros, ((),))  # the loss, which needs the target
    graph.output(tuple(outputs + [env[n] for n in marked]))
    copy = fx.GraphModule(module, graph, class_name=type(module).__name__)
    # export's metadata asserts on values only the loss used would keep that part (and its inputs) alive
    copy.graph.eliminate_dead_code(lambda n: n.is_impure() and n.target is not _ASSERT_METADATA)
    copy.recompile()
    copy.training = module.training
    return copy, bool(marked)
