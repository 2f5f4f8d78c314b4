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

import torch
import torch.distributed as dist
import torch.fx as fx

from stagewise.compiler.evaluation import Evaluation
from stagewise.ir.errors import PredictError
from stagewise.passes.capture import MODEL_OUTPUT
from stagewise.runtime.distributed import DistributedTransport
from stagewise.runtime.executor import StreamExecutor

UNKNOWN = ("pipe.predict needs the model's output as a value of the traced graph: it is known for a model "
           "compiled in this process whose forward returns one tensor (loss_fn's first argument) or an object "
           "with .logits beside its own .loss; this model returns neither, or the pipeline was loaded (its stage "
           "code does not record the output). Compile it with loss_fn=(output, target) -> loss, or run the model "
           "eagerly to predict")


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
    copy.graph.eliminate_dead_code()
    copy.recompile()
    copy.training = module.training
    return copy, bool(marked)
