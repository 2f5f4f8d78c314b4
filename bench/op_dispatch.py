"""The host's time per op in eager PyTorch, measured beside what the analytic model charges for it.

    python bench/op_dispatch.py                  # about a minute
    python bench/op_dispatch.py --repeats 30

passes/analytic.py charges each op a fixed host dispatch (`OP_DISPATCH_S` per forward op,
`BACKWARD_OP_RATIO` times that for its backward): Python, the dispatcher and autograd's bookkeeping,
which the roofline does not see and which decides a small layer's time. This measures it on tiny
sizes (so the kernels cost next to nothing): a chain of cheap functional ops, and the test zoo's
GPT blocks as torch.export and torch.fx trace them, each traced as compile traces it (with its
loss), its ops counted by the analytic model's own `dispatches`, timed with autograd recording
(a training forward) and forward + backward. Per op is the marginal cost: the time of a
chain of 2k blocks minus that of k blocks over the ops they differ by, so the call, the loss and
the backward engine's start cancel. Times are this thread's CPU time (time.thread_time: on CPU
tensors the forward, the backward and their kernels all run on the calling thread), so other
processes' load, which takes the core away, does not count; on a quiet machine it is the wall time.
Each is the least disturbed (the minimum) of --repeats rounds of torch.utils.benchmark. One
intra-op thread, as the benchmarks run devices. Nothing is asserted.
"""

from __future__ import annotations

import argparse
import time

import _common
import torch
import torch.nn as nn
import torch.nn.functional as F
from rich.table import Table
from torch.utils.benchmark import Timer

from stagewise.passes.analytic import BACKWARD_OP_RATIO, OP_DISPATCH_S, dispatches
from stagewise.passes.capture import trace

WIDTH, ROWS = 16, 4


class MatmulGeluAdd(nn.Module):
    """Functional ops on weights, the cheapest kind: x = gelu(x @ w) + x per block (3 ops)."""

    def __init__(self, blocks: int):
        super().__init__()
        self.weights = nn.ParameterList(nn.Parameter(torch.randn(WIDTH, WIDTH) * 0.1) for _ in range(blocks))

    def forward(self, x):
        for w in self.weights:
            x = F.gelu(x @ w) + x
        return x


def matmul_chain(blocks: int) -> _common.Case:
    return _common.Case("chain", "matmul + gelu + add", MatmulGeluAdd(blocks), (torch.randn(ROWS, WIDTH),),
                        torch.randn(ROWS, WIDTH), F.mse_loss)


def tiny_gpt(blocks: int, model=None) -> _common.Case:
    """The test zoo's GPT (d=32, 4 heads, 16 tokens): its blocks' op mix as a model has it."""
    gpt = _common.tests_models()
    ids, target = torch.randint(0, 64, (2, 16)), torch.randint(0, 64, (2, 16))
    return _common.Case("gpt", "TinyGPT", (model or gpt.TinyGPT)(layers=blocks), (ids,), target, gpt.lm_loss)


def dropout_gpt(blocks: int) -> _common.Case:
    """The same blocks written for torch.fx (the residual adds are Python operators)."""
    _common.tests_models()
    from tests.models.dropout import DropoutGPT  # noqa: PLC0415 - needs the repository root on sys.path first

    return tiny_gpt(blocks, lambda layers: DropoutGPT(p=0.0, layers=layers))


CASES = {"matmul + gelu + add": matmul_chain, "TinyGPT blocks": tiny_gpt, "DropoutGPT blocks (p=0)": dropout_gpt}


def least_seconds(stmt: str, scope: dict, repeats: int) -> float:
    """The least disturbed of `repeats` rounds (each about 0.1 s) of `stmt`: seconds per run."""
    timer = Timer(stmt=stmt, globals=scope, timer=time.thread_time)
    number = max(1, int(0.1 / timer.timeit(3).mean))
    return min(timer.timeit(number).mean for _ in range(repeats))


def case_seconds(case, blocks: int, repeats: int) -> tuple[str, int, float, float]:
    """The tracer, the ops `dispatches` counts in the traced graph (what the analytic model charges),
    and the graph's forward and backward seconds."""
    problem = case(blocks)
    traced = trace(problem.model, problem.inputs, problem.target, problem.loss_fn)
    ops = sum(map(dispatches, traced.graph_module.graph.nodes))
    scope = {"graph": traced.graph_module, "args": (*problem.inputs, problem.target)}
    forward = least_seconds("graph(*args)", scope, repeats)
    both = least_seconds("graph(*args).backward()", scope, repeats)
    return traced.tracer, ops, forward, both - forward


def per_op(case, blocks: int, repeats: int) -> tuple[str, float, float]:
    """The tracer, and the marginal forward and backward seconds per op: 2k blocks against k."""
    tracer, ops_k, fwd_k, bwd_k = case_seconds(case, blocks, repeats)
    _, ops_2k, fwd_2k, bwd_2k = case_seconds(case, 2 * blocks, repeats)
    extra = ops_2k - ops_k
    return tracer, (fwd_2k - fwd_k) / extra, (bwd_2k - bwd_k) / extra


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--blocks", type=int, default=8, help="blocks in the shorter chain (twice as many in the longer)")
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--no-pin", action="store_true", help="keep the environment's intra-op threads")
    args = p.parse_args()
    console = _common.start(args, width=110, fresh_cache=False)
    table = Table(title=f"host CPU time per op (µs), least of {args.repeats} rounds")
    for column in ("", "forward", "backward", "backward / forward"):
        table.add_column(column, justify="right" if column else "left")
    table.add_row("charged (passes/analytic.py)", f"{OP_DISPATCH_S * 1e6:.1f}",
                  f"{OP_DISPATCH_S * BACKWARD_OP_RATIO * 1e6:.1f}", f"{BACKWARD_OP_RATIO:.2f}")
    for name, case in CASES.items():
        tracer, forward, backward = per_op(case, args.blocks, args.repeats)
        table.add_row(f"measured: {name} ({tracer})", f"{forward * 1e6:.1f}", f"{backward * 1e6:.1f}",
                      f"{backward / forward:.2f}")
    console.print(table)


if __name__ == "__main__":
    main()
