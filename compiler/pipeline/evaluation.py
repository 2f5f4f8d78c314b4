"""Evaluation and the train/eval mode of a pipeline (`pipe.evaluate`, `pipe.train`, `pipe.eval`).

`evaluate` runs the forward-only programs (passes/forward_only.py) through an executor of their own
over the same workers and transport, so a failure rolls back and the deadline holds as in `step`,
while the training executor's step count, random-op bookkeeping and deviation plans stay untouched.
The stage modules run in eval mode (dropout keeps its input: ir/random_streams.py; BatchNorm reads
its running statistics) without autograd, and afterwards nothing the pass held is left: no input,
output or stash in a worker, the pools' accounting as before.

The mode of a stage module decides what its `call_module` leaves and keyed dropout do. What a graph
fixed when it was traced cannot follow the mode: a dropout traced in eval mode (left as it was, so
in train mode it would draw from no keyed stream, or stay off) and an ATen op whose `training`
flag is a literal (torch.export's BatchNorm). Switching to a mode such an op contradicts is refused.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from stagewise.ir.errors import ModeError
from stagewise.ir.plan import Plan
from stagewise.passes.forward_only import forward_only_programs
from stagewise.runtime.distributed import DistributedTransport
from stagewise.runtime.executor import StreamExecutor
from stagewise.runtime.pool import MemoryPool
from stagewise.runtime.transport import LocalTransport
from stagewise.runtime.undo import clear_step
from stagewise.runtime.worker import StageWorker

_DROPOUT_FUNCTIONS = (F.dropout, torch.ops.aten.dropout.default)
_MODE_FLAGS = ("training", "train")
T = TypeVar("T")
RECOMPILE = "compile the model in the mode to train in (model.train() before sw.compile); pipe.eval() then evaluates it"


class Evaluation:
    """The pipeline's mode and its forward-only executor (built at the first `evaluate`)."""

    def __init__(self, plan: Plan, workers: list[StageWorker], pools: list[MemoryPool],
                 transport: LocalTransport | DistributedTransport):
        self.plan, self.workers, self.pools, self.transport = plan, workers, pools, transport
        self.training = plan.training
        self._executor: StreamExecutor | None = None
        for worker in workers:
            worker.module.training = plan.training  # the children keep the modes they were compiled with

    def set_mode(self, training: bool) -> None:
        """Every stage module (and its children) in `training` mode, as nn.Module.train does."""
        for worker in self.workers:
            _check_mode(self.plan, worker.module, training)
        for worker in self.workers:
            worker.module.train(training)
        self.training = training

    def evaluate(self, microbatches: int, feed, training_executor: StreamExecutor) -> torch.Tensor:
        """The mean loss of one forward-only pass in eval mode; nothing is updated or counted."""
        return self.forward_pass(microbatches, feed, training_executor, lambda: None)[0]

    def forward_pass(self, microbatches: int, feed, training_executor: StreamExecutor,
                     collect: Callable[[], T]) -> tuple[torch.Tensor, T]:
        """One forward-only pass in eval mode: its mean loss, and what `collect` read from the workers
        after it (their outputs, before they are cleared)."""
        training_executor.settle()
        swapped = self._swapped_stages()
        if swapped:
            raise ModeError(f"evaluate cannot run stages {swapped} yet: their weights live in host memory between "
                            "uses (swapping); compile with swap='off' or more device memory to evaluate")
        executor = self._forward_executor(training_executor)
        executor.state.timeout_s = training_executor.state.timeout_s
        modes = [(m, m.training) for w in self.workers for m in w.module.modules()]
        ledgers = [pool.ledger() for pool in self.pools]
        training = self.training
        self.set_mode(False)
        try:
            loss = executor.run(microbatches, feed=feed)
        finally:
            for module, mode in modes:
                module.training = mode
            self.training = training
        collected = collect()
        for worker in self.workers:
            clear_step(worker)
        for pool, ledger in zip(self.pools, ledgers, strict=True):
            pool.restore(ledger)
        return loss, collected

    def _swapped_stages(self) -> list[int]:
        """Every stage that swaps, of every rank (the plan's), so that under torch.distributed every
        rank refuses alike instead of the others waiting for the one that refused."""
        local = {w.stage.index for w in self.workers if w.swapped}
        return sorted(local.union(self.plan.costs.swapped if self.plan.costs is not None else ()))

    def _forward_executor(self, training_executor: StreamExecutor) -> StreamExecutor:
        if self._executor is None:
            local = {p.device for p in training_executor.programs}
            programs = tuple(p for p in forward_only_programs(self.plan) if p.device in local)
            self._executor = StreamExecutor(programs, self.workers, self.transport, None,
                                            training_executor.state.device_of, opportunistic=False, seed=self.plan.seed,
                                            precision=self.plan.precision)
            self._executor.state.loss_weights = training_executor.state.loss_weights  # the feed sets the step's weights
        return self._executor


def _check_mode(plan: Plan, module: fx.GraphModule, training: bool) -> None:
    """Refuse `training` where the stage's graph fixed the other mode when it was traced."""
    if training and plan.tracer == "export" and not plan.training:
        raise ModeError("this pipeline cannot train in train mode: torch.export traced the model in eval mode, "
                        f"which bakes dropout's mode into the graph (or removes it); {RECOMPILE}")
    for node in module.graph.nodes:
        fixed = _fixed_mode(module, node)
        if fixed is not None and fixed != training:
            wanted = "train" if training else "eval"
            raise ModeError(f"this pipeline cannot run in {wanted} mode: `{node.format_node()}` fixed the mode it "
                            f"was traced in ({'train' if fixed else 'eval'}); {RECOMPILE}")


def _fixed_mode(module: fx.GraphModule, node: fx.Node) -> bool | None:
    """The mode a node fixed when traced (None where it follows the module's mode or has none)."""
    if node.op == "call_module":
        leaf = module.get_submodule(str(node.target))
        drawing = isinstance(leaf, nn.modules.dropout._DropoutNd) and leaf.p > 0
        return False if drawing else None  # a drawing dropout left as a leaf was traced in eval mode
    target = node.target
    if node.op != "call_function":
        return None
    if target in _DROPOUT_FUNCTIONS:  # left as traced: its probability is 0 or its mode was False
        p = node.args[1] if len(node.args) > 1 else node.kwargs.get("p", 0.5)
        return None if p == 0 else False
    if not isinstance(target, torch._ops.OpOverload):
        return None
    for position, argument in enumerate(target._schema.arguments):
        if argument.name in _MODE_FLAGS:
            value = node.args[position] if position < len(node.args) else node.kwargs.get(argument.name)
            return value if isinstance(value, bool) else None
    return None
