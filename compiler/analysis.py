"""The model captured once, and per microbatch count its graph with layers and cut-points.

Node values, transfer shapes and the literal sizes in the stage code are per microbatch size, so
the planner, which weighs several counts, asks for the graph at each. With `dynamic`,
torch.export is asked once for a graph with a symbolic batch, which every size is evaluated
from; a model that cannot keep its batch symbolic is exported again at each size
(passes/capture.Capture). fx graphs are traced once either way. With one count known in
advance, `dynamic=False` exports statically: about half the time of a symbolic export.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from stagewise.compiler.batches import first_microbatch, split_batch
from stagewise.ir.plan import Cut, Layer
from stagewise.passes.capture import Capture, capture
from stagewise.passes.cutpoints import find_cuts
from stagewise.passes.layers import build_layers


@dataclass(frozen=True)
class Analysed:
    """The graph at one microbatch size, its layers and the cut-points between them."""

    graph: fx.GraphModule
    layers: tuple[Layer, ...]
    cuts: tuple[Cut, ...]
    microbatch_size: int
    graph_inputs: tuple[str, ...]  # placeholder names, in order

    @property
    def param_bytes(self) -> int:
        return sum(layer.param_bytes for layer in self.layers)

    @property
    def legal_cuts(self) -> int:
        return sum(c.legal for c in self.cuts)


class Analysis:
    """One capture of the model (+ loss), evaluated at each microbatch count asked for, once."""

    def __init__(self, model: torch.nn.Module, inputs, target, loss_fn, batch: int, first_microbatches: int, *,
                 dynamic: bool):
        self.model, self.inputs, self.target, self.batch = model, inputs, target, batch
        self.dynamic = dynamic
        self.first_microbatches = first_microbatches
        self.graphs: dict[int, Analysed] = {}
        # Export at a size of at least 2 where the batch allows: export fixes a size of 1 (0/1 specialisation).
        example_m = first_microbatches
        if dynamic and batch // first_microbatches < 2 and batch > 1:
            example_m = max(m for m in range(1, batch) if batch % m == 0 and batch // m >= 2)
        self.capture: Capture = capture(model, split_batch(inputs, example_m)[0], first_microbatch(target, example_m),
                                        loss_fn, dynamic=dynamic)

    @property
    def tracer(self) -> str:
        return self.capture.tracer

    @property
    def target_name(self) -> str | None:
        return self.capture.target_name

    @property
    def first(self) -> Analysed:
        """The graph at the first microbatch count (layers and per-sample bytes do not depend on the
        size, so the planner weighs every candidate on it)."""
        return self.at(self.first_microbatches)

    def at(self, microbatches: int) -> Analysed:
        """The graph at the size of one of `microbatches` microbatches, with its layers and cut-points."""
        if microbatches not in self.graphs:
            size = self.batch // microbatches
            traced = self.capture.at(split_batch(self.inputs, microbatches)[0],
                                     first_microbatch(self.target, microbatches))
            gm = traced.graph_module
            layers = build_layers(gm, self.model)
            self.graphs[microbatches] = Analysed(gm, layers, find_cuts(gm, layers, size), size, traced.graph_inputs)
        return self.graphs[microbatches]

    def graph_at_size(self, size: int) -> fx.GraphModule:
        """The graph at microbatch size `size` (the profiler's probes): the example's first samples,
        repeated where the example has fewer."""
        def rows(value):
            if not isinstance(value, torch.Tensor) or value.dim() == 0:
                return value
            return value.repeat(-(-size // value.shape[0]), *[1] * (value.dim() - 1))[:size]

        inputs = {k: rows(v) for k, v in self.inputs.items()} if isinstance(self.inputs, dict) else tuple(
            rows(v) for v in self.inputs)
        return self.capture.at(inputs, rows(self.target)).graph_module
