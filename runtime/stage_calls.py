"""How a worker calls its stage module on a training forward: as it is, through torch.compile
(`compile_stages`), or as CUDA graphs of its forward and backward (`cuda_graphs`).

Both reuse what they made across steps: torch.compile keeps its compiled graphs per shape (dynamo's
cache, guarded by the shapes, the grad mode and the module's mode), and a graphed stage keeps one
captured forward and backward per (microbatch, input shapes). A graph replays into fixed buffers,
so each microbatch in flight needs its own: microbatch 1's forward must not overwrite microbatch
0's saved activations before its backward ran (1F1B and GPipe hold several at once).

A graph is captured between steps, never while the stream threads run: the first step of a
microbatch shape runs eagerly and keeps a copy of the stage's inputs, and `capture_pending`,
called before the next step, captures the stage with them (torch.cuda.make_graphed_callables). The
parameters' and buffers' storage is recorded at capture: where it moved (load_state_dict, a
restore), the graphs would read stale memory, so they are dropped and captured again.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import cast

import torch
import torch.fx as fx

from stagewise.ir.errors import OptionError
from stagewise.ir.precision import AUTOCAST_DTYPES
from stagewise.ir.random_streams import keyed, keyed_dropout

StageCall = Callable[[torch.nn.Module, int, Sequence[object]], tuple]
Signature = tuple[int, tuple[tuple[torch.Size, torch.dtype, bool], ...]]  # (microbatch, each input's form)


@dataclass(frozen=True)
class Acceleration:
    """What compile asked of the stage calls: torch.compile, CUDA graphs, and whether the steps'
    sequences are padded to buckets (else a graphed microbatch keeps the shape it was captured at)."""

    compile_stages: bool = False
    cuda_graphs: bool = False
    bucketed: bool = False


EAGER = Acceleration()  # the stage modules called as they are


class CompiledStage:
    """The stage module through torch.compile (inductor), sharing the module's parameters; any other
    module the worker runs (predict's copy) is called as it is. Keyed random ops run eagerly between
    the compiled pieces: dynamo fails tracing their seeds (torch 2.13, two dropouts in a stage: a
    RecursionError in its struct.pack polyfill), and eagerly they draw the pipeline's masks."""

    def __init__(self, module: fx.GraphModule):
        self.module = module
        self.copy = _random_ops_eager(module)
        self.compiled = torch.compile(self.copy)

    def __call__(self, module: torch.nn.Module, microbatch: int, args: Sequence[object]) -> tuple:
        if module is not self.module:
            return module(*args)
        self.copy.training = module.training  # evaluate and pipe.train switch the stage module's mode
        return self.compiled(*args)


_EAGER_RANDOM = {keyed: torch.compiler.disable(keyed), keyed_dropout: torch.compiler.disable(keyed_dropout)}


def _random_ops_eager(module: fx.GraphModule) -> fx.GraphModule:
    """A module of the same code over the same parameters, its keyed random ops left to eager."""
    graph = fx.Graph()
    graph.output(graph.graph_copy(module.graph, {}))
    for node in graph.nodes:
        if node.op == "call_function" and node.target in _EAGER_RANDOM:
            node.target = _EAGER_RANDOM[node.target]
    copied = fx.GraphModule(module, graph, class_name=type(module).__name__)
    copied.training = module.training
    return copied


class _Forward(torch.nn.Module):
    """The stage module as a child: make_graphed_callables replaces this wrapper's forward (and takes
    its parameters, the stage's own), never the stage module's. The forward runs under the precision's
    autocast and the backward outside it, as the eager pipeline runs them; without autocast's cast
    cache, which a capture cannot take (the casts are captured, so each replay casts the weights anew)."""

    def __init__(self, module: torch.nn.Module, precision: str):
        super().__init__()
        self.stage = module
        dtype = AUTOCAST_DTYPES[precision]
        self.autocast = (contextlib.nullcontext() if dtype is None
                         else torch.autocast("cuda", dtype=dtype, cache_enabled=False))

    def forward(self, *args: torch.Tensor) -> tuple:
        with self.autocast:
            return self.stage(*args)


class GraphedStage:
    """One stage's CUDA graphs: replayed for a training forward (grad on, module in training mode)
    of a captured (microbatch, input shapes); any other call runs the module eagerly."""

    def __init__(self, module: torch.nn.Module, stage: int, precision: str, bucketed: bool):
        self.module = module
        self.stage = stage
        self.precision = precision
        self.bucketed = bucketed
        self.graphs: dict[Signature, Callable[..., tuple]] = {}
        self.pending: dict[Signature, tuple[torch.Tensor, ...]] = {}  # inputs of shapes seen, to capture with
        self.storage = _storage(module)

    def __call__(self, module: torch.nn.Module, microbatch: int, args: Sequence[object]) -> tuple:
        if module is not self.module or not (module.training and torch.is_grad_enabled()):
            return module(*args)
        key = (microbatch, tuple(_form(self.stage, a) for a in args))
        graphed = self.graphs.get(key)
        if graphed is not None:
            return graphed(*args)
        self._check_new_shape(key)
        self.pending.setdefault(key, tuple(_sample(a) for a in args if isinstance(a, torch.Tensor)))
        return module(*args)

    def _check_new_shape(self, key: Signature) -> None:
        """Without buckets every step would capture again at each new length: refused."""
        if self.bucketed:
            return
        other = next((k for k in (*self.graphs, *self.pending) if k[0] == key[0] and k != key), None)
        if other is not None:
            raise OptionError(
                f"cuda_graphs=True captured stage {self.stage}'s microbatch {key[0]} at input shapes "
                f"{[list(f[0]) for f in other[1]]}, and this step gives {[list(f[0]) for f in key[1]]}: a graph "
                "replays one shape. Give compile shape_buckets= (each bucket is captured once), or steps of one "
                "shape, or drop cuda_graphs")

    def capture_pending(self) -> None:
        """Capture the shapes the last step ran eagerly (no stream thread runs now); drop every graph
        first where the parameters or buffers moved to other memory since they were captured."""
        storage = _storage(self.module)
        if storage != self.storage:
            self.graphs.clear()
            self.storage = storage
        pending, self.pending = self.pending, {}
        for key, sample in pending.items():
            try:
                self.graphs[key] = _capture(self.module, sample, self.precision)
            except RuntimeError as error:  # an op that syncs with the host, or one CUDA graphs cannot hold
                raise OptionError(f"cuda_graphs=True could not capture stage {self.stage}'s forward and backward "
                                  f"({type(error).__name__}: {str(error)[:300]}); drop cuda_graphs for this model "
                                  "(compile_stages=True may speed it up instead)") from error


def stage_call(module: fx.GraphModule, stage: int, precision: str, acceleration: Acceleration) -> StageCall | None:
    """The call a worker makes for its training forwards; None: the module itself."""
    if acceleration.cuda_graphs:
        return GraphedStage(module, stage, precision, acceleration.bucketed)
    if acceleration.compile_stages:
        return CompiledStage(module)
    return None


def capture_pending(calls: Sequence[StageCall | None]) -> None:
    """Before a step: every graphed stage captures what the steps before ran eagerly."""
    for call in calls:
        if isinstance(call, GraphedStage):
            call.capture_pending()


def _form(stage: int, value: object) -> tuple[torch.Size, torch.dtype, bool]:
    """What a graph's input must keep: shape, dtype and whether autograd tracks it."""
    if not isinstance(value, torch.Tensor):
        raise OptionError(f"cuda_graphs=True: stage {stage} takes a {type(value).__name__} input, and a CUDA graph "
                          "takes tensors only; drop cuda_graphs")
    return value.shape, value.dtype, value.requires_grad


def _sample(value: torch.Tensor) -> torch.Tensor:
    """A copy of an input to capture with, tracked by autograd as the input is."""
    return value.detach().clone().requires_grad_(value.requires_grad)


def _storage(module: torch.nn.Module) -> tuple[int, ...]:
    """Where the parameters and buffers a graph reads and writes live."""
    return tuple(t.data_ptr() for t in (*module.parameters(), *module.buffers()))


def _capture(module: torch.nn.Module, sample: tuple[torch.Tensor, ...], precision: str) -> Callable[..., tuple]:
    """The stage's forward and backward captured with `sample` as inputs. The warm-up forwards
    make_graphed_callables runs first would move BatchNorm's running statistics: put back after."""
    buffers = [b.detach().clone() for b in module.buffers()]
    device = next((t.device for t in (*sample, *module.parameters())), torch.device("cuda"))
    with torch.cuda.device(device):
        graphed = cast(torch.nn.Module,  # a module in, the module out with its forward replaced
                       torch.cuda.make_graphed_callables(_Forward(module, precision), sample, allow_unused_input=True))
    with torch.no_grad():
        for buffer, saved in zip(module.buffers(), buffers, strict=True):
            buffer.copy_(saved)
    return graphed.forward
