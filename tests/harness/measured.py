"""The sizes and seconds the runtime measured in the step just run, as the simulator's costs: the
simulator and the runtime interpret the same programs (tests/test_differential.py)."""

from __future__ import annotations

import statistics

import stagewise as sw
from stagewise.ir.instructions import (
    Backward,
    Forward,
    HostUpdate,
    InputGrad,
    Recompute,
    Stream,
    Update,
    WeightGrad,
)
from stagewise.passes.simulate import SimCost, transfer_bytes


def measured_cost(pipe: sw.Pipeline) -> SimCost:
    """The plan's programs, charged the sizes the runtime holds: state per stage and stash per microbatch."""
    stages = pipe.plan.stages
    state, grads = [0.0] * len(stages), [0.0] * len(stages)
    for worker in pipe._workers:
        layers = pipe.plan.layers  # a swapped stage's parameters are empty on the device between uses
        grads[worker.stage.index] = float(sum(layers[i].param_bytes for i in worker.stage.layers))
        if not worker.swapped:  # weights, optimizer state and buffers stay; gradients come and go
            weights = sum(p.numel() * p.element_size() for p in worker.params.values())
            optimizer = sum(t.numel() * t.element_size() for t in worker.tensors("optimizer").values())
            buffers = sum(b.numel() * b.element_size() for b in worker.module.buffers())
            state[worker.stage.index] = float(weights + optimizer + buffers)
    stash = [0.0] * len(stages)
    for worker in pipe._workers:
        stash[worker.stage.index] = float(max((v for (grad, _), v in worker.stash_size.items() if grad), default=0))
    forward, backward, update, input_grad = measured_seconds(pipe)
    share = tuple(b and g / b for b, g in zip(backward, input_grad, strict=True))
    recorded = [0.0] * len(stages)
    for worker in pipe._workers:
        recorded[worker.stage.index] = float(worker.recorded_bytes)
    return SimCost(forward_s=forward, backward_s=backward, update_s=update, input_grad_share=share,
                   recorded_bytes=tuple(recorded),
                   state_bytes=tuple(state),
                   grad_bytes=tuple(grads), stash_bytes=tuple(stash),
                   value_bytes=transfer_bytes(pipe.plan.transfers, pipe.plan.microbatch_size))


def measured_seconds(pipe: sw.Pipeline) -> tuple[tuple[float, ...], ...]:
    """Each stage's median forward, backward and update seconds in the step just run (the overlaps
    that decide a peak depend on how long each stage computes), and of a split backward's input
    gradient; a split backward's seconds are its halves' medians added."""
    spans: dict[tuple[type, int], list[float]] = {}
    for device, _, index, start, end in pipe._executor.state.step.timeline:
        ins = pipe.plan.programs[device].instructions[index]
        if isinstance(ins, (Forward, Recompute, Backward, InputGrad, WeightGrad, Update, HostUpdate)):
            kind = Forward if isinstance(ins, Recompute) else HostUpdate if isinstance(ins, Update) else type(ins)
            spans.setdefault((kind, ins.stage), []).append(end - start)
    stages = range(len(pipe.plan.stages))
    forward, whole, update, input_grad, weight_grad = (
        tuple(statistics.median(spans.get((kind, s), [0.0])) for s in stages)
        for kind in (Forward, Backward, HostUpdate, InputGrad, WeightGrad))
    backward = tuple(w or b + g for w, b, g in zip(whole, input_grad, weight_grad, strict=True))
    return forward, backward, update, input_grad


def stream_orders(pipe: sw.Pipeline) -> dict[tuple[int, Stream], list[int]]:
    """Per device and stream, the instructions it ran, in the order they started."""
    runs: dict[tuple[int, Stream], list[tuple[float, int]]] = {}
    for device, stream, index, start, _ in pipe._executor.state.step.timeline:
        runs.setdefault((device, stream), []).append((start, index))
    return {key: [i for _, i in sorted(v)] for key, v in runs.items()}
