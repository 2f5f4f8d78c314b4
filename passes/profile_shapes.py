"""The graph at microbatch size u, on fake tensors: every value's shape and each layer's bytes.

Shapes and memory at a size u come from torch's FakeTensorMode (shapes and dtypes, no
storage), so the search for the largest microbatch allocates nothing. The stash is what
autograd saves for the backward (counted with saved_tensors_hooks; parameters excluded); the
workspace estimate here is a layer's largest single intermediate.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_flatten

from stagewise.ir.errors import ProfileError
from stagewise.ir.plan import Layer
from stagewise.ir.precision import autocast_for
from stagewise.ir.subgraph import attribute


@dataclass
class Shapes:
    """Every node's value at one microbatch size (fake tensors), and per-layer byte counts."""

    u: int
    values: dict[str, Any]
    input_bytes: list[int]
    act_bytes: list[int]
    stash_bytes: list[int]
    largest_bytes: list[int]  # the largest single intermediate: a workspace estimate
    exact: bool = True  # False: scaled from another size, no values to run a layer on
    graph: fx.GraphModule | None = None  # the graph at u, where the traced one runs at its own size only

    def scaled(self, u: int) -> Shapes:
        """Byte counts at u by proportion, for a graph that only runs at the size it was traced at."""
        def scale(xs: list[int]) -> list[int]:
            return [round(x * u / self.u) for x in xs]

        return Shapes(u, {}, scale(self.input_bytes), scale(self.act_bytes), scale(self.stash_bytes),
                      scale(self.largest_bytes), exact=False)


class ShapeCache:
    """Shapes per microbatch size, computed once each.

    A graph captured by torch.export has the traced batch written into its view and reshape
    arguments and runs at that size only; `graph_at(u)` (the capture's graph at size u, with the
    same nodes) then gives each size a graph of its own. Without it other sizes get byte counts
    scaled from the traced size, and only the traced size is probed.
    """

    def __init__(self, gm: fx.GraphModule, layers: Sequence[Layer], traced: int,
                 graph_at: Callable[[int], fx.GraphModule] | None = None, precision: str = "fp32"):
        self.gm, self.layers, self.traced, self.graph_at = gm, layers, traced, graph_at
        self.precision = precision
        self._done: dict[int, Shapes] = {}
        self.static = False  # set at the first size other than the traced one that fails

    def at(self, u: int) -> Shapes:
        if u in self._done:
            return self._done[u]
        if u == self.traced:
            try:
                self._done[u] = shapes_at(self.gm, self.layers, u, self.traced, self.precision)
            except Exception as err:  # noqa: BLE001 - reported as what it means for the user
                raise ProfileError(f"cannot propagate shapes through the traced graph: {err}; "
                                   f"use cost='analytic'") from err
        elif not self.static:
            try:
                with quiet_fake_tensor_log():
                    self._done[u] = shapes_at(self.gm, self.layers, u, self.traced, self.precision)
            except Exception:  # noqa: BLE001 - any failure: the graph is specialised to its size
                self.static = True
        if u not in self._done and self.graph_at is not None:
            try:
                graph = self.graph_at(u)
                self._done[u] = replace(shapes_at(graph, self.layers, u, u, self.precision), graph=graph)
            except Exception:  # noqa: BLE001 - this size cannot be captured: scaled below
                pass
        if u not in self._done:
            self._done[u] = self.at(self.traced).scaled(u)
        return self._done[u]


@contextlib.contextmanager
def quiet_fake_tensor_log():
    """FakeTensorMode logs a traceback for an op refusing its sizes, which the caller expects and handles."""
    logger = logging.getLogger("torch._subclasses.fake_tensor")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def shapes_at(gm: fx.GraphModule, layers: Sequence[Layer], u: int, traced: int, precision: str = "fp32") -> Shapes:
    """Run the whole graph on fake inputs whose batch is u: exact shapes of every value at u,
    and the bytes autograd saves per layer, without allocating them. Under the precision's
    autocast (for the graph's device type: CPU and CUDA autocast cast matmuls, convolutions and
    linear alike) values and saved tensors have the dtypes training at that precision makes."""
    layer_of = {name: layer.index for layer in layers for name in layer.nodes}
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    # A module's Python forward may update a real buffer in place even on fake inputs
    # (BatchNorm's num_batches_tracked): keep the model as it was.
    buffers = {name: b.clone() for name, b in gm.named_buffers()}
    with mode, _restored(gm, buffers):
        # Autograd saves a real parameter as given, or a fake view of its (memoised) fake; both are
        # state, not stash. The fakes are kept alive so their storage ids stay valid.
        state = _state_tensors(gm)
        fake_state = [mode.from_tensor(t) for t in state]
        inputs = [_batched_fake(n.meta.get("val"), u, traced) for n in gm.graph.nodes if n.op == "placeholder"]
        saved = _SavedBytes(set(layer_of.values()), {storage_id(t) for t in (*state, *fake_state)})
        recorder = _Recorder(gm, layer_of, saved)
        with torch.autograd.graph.saved_tensors_hooks(saved.pack, _never_unpacked), \
                autocast_for(precision, _graph_device(state)):
            recorder.run(*inputs)
    values = recorder.values
    n = len(layers)
    return Shapes(
        u=u,
        values=values,
        input_bytes=[sum(tree_bytes(values[v]) for v in layer.inputs) for layer in layers],
        act_bytes=[sum(tree_bytes(values[v]) for v in layer.outputs) for layer in layers],
        stash_bytes=[sum(saved.by_layer[i].values()) for i in range(n)],
        largest_bytes=[max((tree_bytes(values[v]) for v in layer.nodes), default=0) for layer in layers],
    )


@contextlib.contextmanager
def _restored(gm: fx.GraphModule, buffers: dict[str, torch.Tensor]):
    try:
        yield
    finally:
        with torch.no_grad(), _no_fake_mode():
            for name, b in gm.named_buffers():
                b.copy_(buffers[name])


def _no_fake_mode():
    return torch._subclasses.fake_tensor.unset_fake_temporarily()


class _SavedBytes:
    """Per layer, the storages autograd saves (state excluded), counted by a pack hook that keeps
    no tensor. A hook returning the tensor would let an op's output hold, through its grad_fn's
    saved variable, itself: a cycle through C++ that gc cannot see, which kept every compile's
    graph, parameters and fake values alive. The hook refers to this object only (not to the
    interpreter or its values) for the same reason."""

    def __init__(self, layers: set[int], state_ids: set[int]):
        self.state_ids = state_ids
        self.by_layer: dict[int, dict[int, int]] = {i: {} for i in layers}
        self.current: int | None = None  # the layer of the node running now
        # the storages counted, kept alive until the count is done: a freed storage's identity may be
        # reused by the next, which would then count once for two (and differ from run to run)
        self.kept: list[torch.UntypedStorage] = []

    def pack(self, t: torch.Tensor) -> None:
        sid = storage_id(t)
        if self.current is not None and sid not in self.state_ids:
            storage = t.untyped_storage()
            self.kept.append(storage)
            self.by_layer[self.current][sid] = storage.nbytes()


def _never_unpacked(_: None) -> torch.Tensor:
    """The fake graph is run for shapes and never differentiated."""
    raise ProfileError("internal: a backward reached the shape-propagation graph, which keeps no saved tensor")


class _Recorder(fx.Interpreter):
    """Keeps every node's value and tells `saved` which layer is running."""

    def __init__(self, gm: fx.GraphModule, layer_of: dict[str, int], saved: _SavedBytes):
        super().__init__(gm, garbage_collect_values=False)
        self.layer_of, self.saved = layer_of, saved
        self.values: dict[str, Any] = {}

    def run_node(self, n: fx.Node):
        self.saved.current = self.layer_of.get(n.name)
        result = super().run_node(n)
        self.values[n.name] = result
        return result


def _batched_fake(value, u: int, traced: int):
    """A fake graph input like `value` with its batch dimension (dim 0) set to u."""
    if not isinstance(value, torch.Tensor):
        return value
    shape = list(value.shape)
    if shape and shape[0] == traced:
        shape[0] = u
    return torch.empty(shape, dtype=value.dtype, device=value.device, requires_grad=value.requires_grad)


# ---- tensor bytes and identities ----------------------------------------------------------------------
def tree_bytes(value) -> int:
    """Bytes of the tensors in a value (a tensor, or tuples / lists / dicts of them)."""
    flat, _ = tree_flatten(value)
    return sum(nbytes(t) for t in flat if isinstance(t, torch.Tensor))


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def storage_id(t: torch.Tensor) -> int:
    """Identity of a tensor's storage: views of one tensor share it."""
    return t.untyped_storage()._cdata


def _state_tensors(gm: fx.GraphModule) -> list[torch.Tensor]:
    tensors = [*gm.parameters(), *gm.buffers()]
    tensors += [v for n in gm.graph.nodes if n.op == "get_attr"
                for v in [attribute(gm, n.target)] if isinstance(v, torch.Tensor)]
    return tensors


def _graph_device(state: list[torch.Tensor]) -> torch.device:
    """Where the graph's state lives (its fakes keep that device): the autocast to propagate under."""
    return state[0].device if state else torch.device("cpu")
