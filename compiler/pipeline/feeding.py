"""Feeding a pass its microbatches: `step`'s, `evaluate`'s and `predict`'s inputs checked, split
and handed to the stage workers, the loss weights to the executor and the sizes of what is sent
to the transport. One object per pipeline, holding what the checks read.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch

from stagewise.compiler.assembly.loss_reduction import LossReduction
from stagewise.compiler.assembly.runtime_setup import Runtime
from stagewise.compiler.assembly.shape_buckets import Padding
from stagewise.compiler.assembly.step_shapes import StepShapes, TransferSpecs
from stagewise.compiler.pipeline.prediction import prediction_pieces
from stagewise.compiler.pipeline.small_batches import GivenSamples, filled
from stagewise.compiler.pipeline.step_inputs import prepare_batch, training_inputs
from stagewise.compiler.pipeline.step_notices import StepNotices
from stagewise.compiler.pipeline.token_ids import check_token_ids, embedding_bounds
from stagewise.ir.errors import PrecisionError
from stagewise.ir.plan import Plan
from stagewise.runtime.precision import enclosing_autocast


class Feeding:
    """The inputs of a pipeline's passes, checked against what its stage code takes."""

    def __init__(self, plan: Plan, runtime: Runtime, padding: Padding | None = None):
        self.plan = plan
        self.runtime = runtime
        self.padding = padding  # how step's and evaluate's sequences are padded (compile's shape_buckets)
        self.token_bounds = embedding_bounds(plan, [w.module for w in runtime.workers])  # ids each input may hold
        self.step_shapes = StepShapes(plan, runtime.stage_modules, runtime.stage_states,
                                      [pool.device for pool in runtime.pools])

    def checked(self, feeder: Callable[[], Callable[[], None]]) -> Callable[[], None]:
        """The feed of a step, an evaluation or a prediction, from `feeder`, which checks the inputs.
        In one process they are checked now; under torch.distributed when the pass begins, so that
        inputs one rank refuses fail it on every rank at once (the others raise StepFailedError)
        instead of leaving them waiting."""
        if self.runtime.context is None:
            return feeder()
        return lambda: feeder()()

    def for_prediction(self, args, kwargs, given: GivenSamples) -> Callable[[], None]:
        """What feeds the workers a prediction's microbatches (compiler/pipeline/prediction.py `prediction_pieces`)."""
        pieces = prediction_pieces(self.plan, self.step_shapes.modules, args, kwargs, given, self.token_bounds)
        return lambda: self.feed(pieces)

    def for_batch(self, args, target, kwargs, reduction: LossReduction | None, notices: StepNotices,
                  evaluating: bool = False) -> Callable[[], None]:
        """What feeds the workers a minibatch's microbatches, checked as `step` (or `evaluate`, filled) takes them."""
        call = "evaluate" if evaluating else "step"
        inputs = training_inputs(self.plan, args, target, kwargs, call)
        inputs = filled(self.plan, inputs) if evaluating else inputs
        prepared = prepare_batch(self.plan, self.step_shapes, inputs, reduction, notices, call, self.padding)
        check_token_ids(inputs, self.token_bounds, call)
        return lambda: self.feed(prepared.pieces, prepared.weights, prepared.transfer_specs)

    def feed(self, pieces: Sequence[Mapping[str, torch.Tensor | None]], weights: tuple[float, ...] | None = None,
             transfer_specs: TransferSpecs | None = None) -> None:
        """Give each worker its inputs of every microbatch it runs (a failed step clears them), the
        executors each microbatch's loss weight (None: 1 / microbatches), and the transport the sizes
        of what is sent where they are not the plan's (compiler/assembly/step_shapes.py)."""
        self.runtime.executor.state.loss_weights.weights = weights
        self.runtime.transport.transfer_specs = transfer_specs
        for worker in self.runtime.workers:
            for mb, piece in enumerate(pieces):
                if worker.stage.microbatches and mb not in worker.stage.microbatches:
                    continue
                for name in worker.stage.inputs:
                    if name in piece:
                        worker.provide(mb, name, piece[name])


def refuse_enclosing_autocast(call: str) -> None:
    """torch.autocast around a call would be ignored (the stages compute on threads of their own)."""
    kind = enclosing_autocast()
    if kind is not None:
        raise PrecisionError(f"pipe.{call} was called under torch.autocast({kind!r}), which the pipeline's stage "
                             "threads do not see; compile with precision='bf16' (or 'fp16') instead, and call "
                             f"{call} outside autocast")
