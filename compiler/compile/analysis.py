"""The model captured once, and per microbatch count its graph with layers and cut-points.

Node values, transfer bytes and costs are per microbatch size, so the planner, which weighs several
counts, asks for the graph at each. torch.export is asked once for a graph whose input sizes are
symbols (batch, sequence length, image size), which every size is evaluated from and whose stage code
then takes any shape (passes/local_sizes.py); a model that cannot keep a size symbolic is exported
again at each size (passes/capture.Capture). fx graphs are shape-agnostic and traced once.
`dynamic` says whether the planner weighs several counts (the profiler then probes several sizes).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.fx as fx

from stagewise.compiler.assembly.batches import first_microbatch, on_model_device, split_batch
from stagewise.ir.plan import Cut, InputSpec, Layer
from stagewise.passes.capture import Capture, capture
from stagewise.passes.cutpoints import find_cuts
from stagewise.passes.layers import build_layers
from stagewise.passes.precision_casts import restore_casts


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
    """One capture of the model (+ loss), evaluated at each microbatch count asked for, once
    (`captured`: one made already, a checkpoint's saved graph: compiler/elastic/replan.py)."""

    def __init__(self, model: torch.nn.Module, inputs, target, loss_fn, batch: int, first_microbatches: int, *,
                 dynamic: bool, precision: str = "fp32", captured: Capture | None = None):
        inputs, target = on_model_device(model, inputs), on_model_device(model, target)
        self.model, self.inputs, self.target, self.batch = model, inputs, target, batch
        self.dynamic = dynamic
        self.precision = precision  # under autocast the trace's fp32 dtype checks are casts (passes/precision_casts.py)
        self.first_microbatches = first_microbatches
        self.graphs: dict[int, Analysed] = {}
        # Export at a size of at least 2 where the batch allows: export fixes a size of 1 (0/1 specialisation).
        example_m = first_microbatches
        if batch // first_microbatches < 2 and batch > 1:
            example_m = max(m for m in range(1, batch) if batch % m == 0 and batch // m >= 2)
        self.capture: Capture = captured or capture(model, split_batch(inputs, example_m)[0],
                                                    first_microbatch(target, example_m), loss_fn, dynamic=True)

    def trainable_per_layer(self) -> list[list[torch.nn.Parameter]]:
        """Each layer's trainable parameters: the optimizer steps those only (a frozen one has no gradient)."""
        first = self.first
        return [[p for p in map(first.graph.get_parameter, layer.params) if p.requires_grad] for layer in first.layers]

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
            if self.precision != "fp32":
                restore_casts(gm, layers)
            self.graphs[microbatches] = Analysed(gm, layers, find_cuts(gm, layers, size), size, traced.graph_inputs)
        return self.graphs[microbatches]

    def input_specs(self, specs: tuple[InputSpec, ...]) -> tuple[InputSpec, ...]:
        """The example's specs with the smallest size each dimension may take at run time."""
        lowest = self.capture.lowest_sizes()
        if lowest is None:  # the graph computes its sizes: whatever its ops take (compiler/assembly/step_shapes.py)
            return tuple(replace(spec, lowest=(1,) * len(spec.shape) if spec.batched else spec.shape) for spec in specs)
        return tuple(replace(spec, lowest=low if spec.batched and len(low) == len(spec.shape) else spec.shape)
                     for spec, low in zip(specs, lowest + [()] * len(specs), strict=False))

    def smallest_microbatch(self, microbatch_size: int) -> int:
        """The fewest samples a microbatch of a step may hold (passes/capture.Capture.smallest_microbatch)."""
        return min(microbatch_size, self.capture.smallest_microbatch(self.inputs, self.target, microbatch_size))

    def graph_at_size(self, size: int) -> fx.GraphModule:
        """The graph at microbatch size `size` (the profiler's probes): the example's first samples,
        repeated where the example has fewer."""
        def rows(value):
            if not isinstance(value, torch.Tensor) or value.dim() == 0:
                return value
            return value.repeat(-(-size // value.shape[0]), *[1] * (value.dim() - 1))[:size]

        inputs = {k: rows(v) for k, v in self.inputs.items()} if isinstance(self.inputs, dict) else tuple(
            rows(v) for v in self.inputs)
        gm = self.capture.at(inputs, rows(self.target)).graph_module
        return restore_casts(gm, build_layers(gm, self.model)) if self.precision != "fp32" else gm
