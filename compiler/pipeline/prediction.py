"""`pipe.predict`: the model's output (what its forward returns, its tensors marked at capture:
passes/model_output.py) of a forward-only pass in eval mode, through the evaluation's executor
(compiler/pipeline/evaluation.py); compiler/pipeline/prediction_output.py puts it together.

Each stage that computes the marked value runs a copy of its graph that also returns it, and each
last stage a copy that returns a zero instead of the loss, with what only the loss needed left out,
so no target is fed. The copies share the stage's parameters, buffers and leaves; the stages' own
modules are back in place afterwards, so training programs and code are untouched. Under
torch.distributed every rank calls it (as `evaluate`): the ranks holding the output send it to
every rank, which returns the whole batch's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
import torch.fx as fx

from stagewise.compiler.assembly.batches import check_step_tensors, split_batch
from stagewise.compiler.pipeline.evaluation import Evaluation
from stagewise.compiler.pipeline.prediction_output import model_output
from stagewise.compiler.pipeline.small_batches import GivenSamples, filled
from stagewise.compiler.pipeline.step_inputs import named_inputs
from stagewise.compiler.pipeline.token_ids import EmbeddingBound, check_token_ids
from stagewise.ir.errors import PlanError, PredictError
from stagewise.ir.plan import Plan
from stagewise.ir.subgraph import MODEL_OUTPUT
from stagewise.runtime.distributed import DistributedTransport
from stagewise.runtime.executor import StreamExecutor

UNKNOWN = ("pipe.predict needs the model's output as values of the traced graph: it is known for a model "
           "compiled (or saved and loaded) whose forward returns tensors, a tuple, a dict or a ModelOutput beside "
           "its loss (its own, or loss_fn's); this model returns only its loss. Return the output and compute the "
           "loss in loss_fn=(output, target) -> loss, or run the model eagerly to predict")
Pieces = dict[str, dict[int, torch.Tensor]]  # per node computing a tensor of the model's output, per microbatch


def predict(evaluation: Evaluation, microbatches: int, feed, training_executor: StreamExecutor,
            samples: Callable[[], int]) -> object:
    """The model's output, each of its tensors the microbatches' concatenated along dim 0 and cut to the
    first `samples()` (the batch given, known once the feed read it: it may have been repeated to fill
    the microbatches), on the CPU."""
    copies = [_predict_module(w.module, w.is_last) for w in evaluation.workers]
    distributed = isinstance(evaluation.transport, DistributedTransport)
    if not distributed and not any(names for _, names in copies):
        raise PredictError(UNKNOWN)
    originals = [w.module for w in evaluation.workers]

    def collect() -> Pieces:
        pieces: Pieces = {}
        for worker, (_, names) in zip(evaluation.workers, copies, strict=True):
            for mb, out in worker.outputs.items() if names else ():
                for name, value in zip(names, out[-len(names):], strict=True):
                    pieces.setdefault(name, {})[mb] = value.detach().cpu()
        return pieces

    for worker, (module, _) in zip(evaluation.workers, copies, strict=True):
        worker.module = module
    try:
        _, pieces = evaluation.forward_pass(microbatches, feed, training_executor, collect)
    finally:
        for worker, module in zip(evaluation.workers, originals, strict=True):
            worker.module = module
    if distributed:
        pieces = _gathered(pieces)
    return model_output(evaluation.plan, pieces, microbatches, samples())


def prediction_pieces(plan: Plan, modules: Sequence[fx.GraphModule | None], args, kwargs, given: GivenSamples,
                      bounds: Sequence[EmbeddingBound]) -> list[dict[str, torch.Tensor | None]]:
    """A prediction's microbatches by graph input, its inputs checked (labels may be left out: the
    loss's target is None) and repeated where too few (compiler/pipeline/small_batches.py); `given` counts
    the samples the caller gave."""
    named = named_inputs(plan, args, fill_unread_inputs(plan, modules, kwargs), "predict")
    inputs = filled(plan, named, given)
    check_step_tensors(inputs, plan.input_specs[:len(inputs)], plan.microbatches, plan.microbatch_size,
                       plan.smallest_microbatch or plan.microbatch_size, "predict")
    check_token_ids(inputs, bounds, "predict")
    pieces: list[dict[str, torch.Tensor | None]] = [
        dict(zip(plan.graph_inputs, piece.values(), strict=False)) for piece in split_batch(inputs, plan.microbatches)]
    if plan.target_name is not None:
        for piece in pieces:
            piece[plan.graph_inputs[len(inputs)]] = None  # the loss, left out, needed it
    return pieces


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


def _gathered(pieces: Pieces) -> Pieces:
    """Every rank's outputs by node and microbatch, on every rank (each rank computed those of its
    stages); PredictError on every rank when no rank knows the model's output."""
    parts: list[Pieces | None] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, pieces)
    merged: Pieces = {}
    for part in parts:
        for name, outputs in (part or {}).items():
            merged.setdefault(name, {}).update(outputs)
    if not merged:
        raise PredictError(UNKNOWN)
    return merged


def _predict_module(module: fx.GraphModule, last: bool) -> tuple[fx.GraphModule, tuple[str, ...]]:
    """The stage's module for predict, and the names of the nodes of the model's output it returns
    last (after the stage's own outputs)."""
    marked = [n for n in module.graph.nodes if n.op != "placeholder" and n.meta.get(MODEL_OUTPUT)]
    if not marked and not last:
        return module, ()
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    copied = graph.graph_copy(module.graph, env)
    if not isinstance(copied, tuple | list):  # codegen's stage modules return a tuple
        raise PlanError(f"stage module {module.__class__.__name__} returns {type(copied).__name__}, not a tuple")
    outputs = list(copied)
    if last:
        outputs[0] = graph.call_function(torch.zeros, ((),))  # the loss, which needs the target
    graph.output(tuple(outputs + [env[n] for n in marked]))
    copy = fx.GraphModule(module, graph, class_name=type(module).__name__)
    # export's metadata asserts on values only the loss used would keep that part (and its inputs) alive
    copy.graph.eliminate_dead_code(lambda n: n.is_impure() and n.target is not _ASSERT_METADATA)
    copy.recompile()
    copy.training = module.training
    return copy, tuple(n.name for n in marked)
