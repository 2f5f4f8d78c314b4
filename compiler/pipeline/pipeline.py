"""The compiled pipeline: what `stagewise.compile` returns and `stagewise.load` restores."""

from __future__ import annotations

import dataclasses

import torch

from stagewise.compiler.assembly.loss_reduction import LossReduction, check_loss_reduction, reduction_to_data
from stagewise.compiler.assembly.options import check_flags
from stagewise.compiler.assembly.runtime_setup import Runtime
from stagewise.compiler.assembly.shape_buckets import padding_to_data
from stagewise.compiler.checkpoint.arguments import checkpoint_path, save_path
from stagewise.compiler.checkpoint.async_save import SaveHandle, SaveSlot
from stagewise.compiler.checkpoint.write import MODEL_GRAPH
from stagewise.compiler.pipeline.evaluation import Evaluation
from stagewise.compiler.pipeline.feeding import Feeding, refuse_enclosing_autocast
from stagewise.compiler.pipeline.morph import Move, restore_into
from stagewise.compiler.pipeline.prediction import predict
from stagewise.compiler.pipeline.readings import Compiled
from stagewise.compiler.pipeline.small_batches import GivenSamples
from stagewise.compiler.pipeline.state import PipelineState
from stagewise.compiler.pipeline.training_state import training_state
from stagewise.compiler.pipeline.virtual_devices import resize
from stagewise.ir.errors import ModeError
from stagewise.ir.plan import Plan
from stagewise.runtime.stage_calls import capture_pending


class Pipeline(PipelineState):
    """Stage modules, their device programs, and the runtime that executes them: what `sw.compile`
    returns and `sw.load` restores, driven like a model and its optimizer in one (`step`). In the
    examples of its methods, `pipe` is `sw.compile(model, ["cpu", "cpu"], (x,),
    loss_fn=F.cross_entropy, example_target=y, microbatches=2)` for a small MLP `model`.

    What it reports (plan parts, last step's figures, stats, `simulate`) comes from
    `PipelineReadings` (compiler/pipeline/readings.py), its state and optimizer from `PipelineState`
    (compiler/pipeline/state.py); each class owns the attributes it reads.

    Args:
        plan: the plan the programs come from.
        runtime: its pools, transport, stage workers and executor in this process.
        compiled: what compiling found beside the plan; None for a loaded pipeline.
        unheld: state_dict entries no stage holds (layers the loss never reaches).

    Example:
        >>> loss = pipe.step(x, target=y)
        >>> loss.shape, len(pipe.stages), pipe.predict(x).shape
        (torch.Size([]), 2, torch.Size([8, 5]))
    """

    def __init__(self, plan: Plan, runtime: Runtime, compiled: Compiled | None = None,
                 unheld: dict[str, torch.Tensor] | None = None):
        super().__init__(plan, runtime, compiled, unheld)
        self._evaluation = Evaluation(plan, runtime.workers, runtime.pools, runtime.transport)
        padding = compiled.padding if compiled is not None else None  # compile's shape_buckets
        self._feeding = Feeding(plan, runtime, padding)  # inputs checked, padded, split and handed out
        self._loss_reduction: LossReduction | None = None
        self._saves = SaveSlot()  # the save in flight (compiler/checkpoint/async_save.py)
        self.loss_reduction = compiled.loss_reduction if compiled is not None else None  # checked
        self._model_graph = compiled.model_graph if compiled is not None else None  # sw.load sets a loaded one's

    @property
    def loss_reduction(self) -> LossReduction | None:
        """How the loss reduces over the batch (compiler/assembly/loss_reduction.py): each microbatch's loss weighs
        its share of the batch's counted items; None weighs each its share of the samples (steps warn
        where targets hold -100). Set by compile's loss_reduction= (a Hugging Face model's own token
        mean by default); checkpoints keep it. Setting it checks it against the plan (LossError).

        Example:
            >>> pipe.loss_reduction is None
            True
            >>> pipe.loss_reduction = sw.SampleMean()
            >>> pipe.loss_reduction
            SampleMean(labels=None)
            >>> pipe.loss_reduction = None
        """
        return self._loss_reduction

    @loss_reduction.setter
    def loss_reduction(self, reduction: LossReduction | None) -> None:
        check_loss_reduction(reduction, self.plan.target_name is not None, list(self.plan.input_names))
        self._loss_reduction = reduction

    @property
    def training(self) -> bool:
        """The mode `step` trains in, as nn.Module's (at first the model's mode at compile).

        Example:
            >>> pipe.training
            True
        """
        return self._evaluation.training

    def train(self, mode: bool = True) -> Pipeline:
        """Set the mode `step` runs the stages in (dropout, BatchNorm), as nn.Module.train does.

        Args:
            mode: True to train, False for eval mode.

        Returns:
            The pipeline itself.

        Raises:
            OptionError: `mode` is not a bool.
            ModeError: the traced graph fixed the mode at compile, so the other mode cannot run.

        Example:
            >>> pipe.train(False).training, pipe.train().training
            (False, True)
        """
        check_flags(mode=mode)
        self._evaluation.set_mode(mode)
        return self

    def eval(self) -> Pipeline:
        """`train(False)`: step then trains with dropout off and BatchNorm's running statistics.

        Returns:
            The pipeline itself.

        Raises:
            ModeError: as `train`.

        Example:
            >>> pipe.eval().training
            False
            >>> pipe.train().training
            True
        """
        return self.train(False)

    def step(self, *args, target=None, **kwargs) -> torch.Tensor:
        """One synchronous training iteration on a minibatch: forward, backward and the optimizer
        update on every stage, as eager training on the whole batch.

        Args:
            *args: the model's inputs, as `example_inputs` gave them (positional).
            target: the loss target, with compile's `loss_fn`.
            **kwargs: the model's inputs, as `example_inputs` gave them (a dict).

        Returns:
            The minibatch's mean loss, a 0-d tensor.

        Raises:
            ModeError: under torch.no_grad() or inference_mode.
            PrecisionError: under torch.autocast (give compile `precision=`).
            ExampleInputsError: inputs not of the compiled form.
            BatchSizeError: a batch larger than compile planned for.
            StepTimeoutError: an instruction outlasted `timeout_s`.
            PipelineBrokenError: a failed step could not be undone.

        Example:
            >>> loss = pipe.step(x, target=y)
            >>> loss.shape, bool(loss > 0)
            (torch.Size([]), True)
        """
        if not torch.is_grad_enabled():
            raise ModeError("step trains (gradients and an update) but was called under torch.no_grad() or "
                            "inference_mode: call pipe.evaluate(...) for the loss without training")
        refuse_enclosing_autocast("step")
        if self._optimizer is not None:
            self._optimizer.push_hyperparameters()
        feed = self._feeding.checked(lambda: self._feeding.for_batch(args, target, kwargs, self.loss_reduction,
                                                                     self._notices))
        capture_pending([w.call for w in self._workers])  # cuda_graphs: while no stream thread runs
        loss = self._executor.run(self.plan.microbatches, feed=feed)
        self._notices.step_done(self._executor)
        if self._optimizer is not None:
            self._optimizer.note_step()
        return loss

    def evaluate(self, *args, target=None, **kwargs) -> torch.Tensor:
        """The mean loss over the microbatches (as `step` returns it) of a forward-only pass in eval mode:
        no gradient, nothing updated, no step counted; the mode `step` trains in is kept. A batch
        smaller than the microbatches is repeated whole to fill them (compiler/pipeline/small_batches.py).

        Args:
            *args: the model's inputs, as `step` takes them.
            target: the loss target, with compile's `loss_fn`.
            **kwargs: the model's inputs, as `step` takes them.

        Returns:
            The mean loss, a 0-d tensor.

        Raises:
            ModeError: a stage swaps its weights, or the graph fixed training mode.
            ExampleInputsError: inputs not of the compiled form.
            BatchSizeError: a batch larger than compile planned for.

        Example:
            >>> before = pipe.state_dict()["0.weight"].clone()
            >>> pipe.evaluate(x, target=y).shape, torch.equal(pipe.state_dict()["0.weight"], before)
            (torch.Size([]), True)
        """
        refuse_enclosing_autocast("evaluate")
        feed = self._feeding.checked(lambda: self._feeding.for_batch(args, target, kwargs, self.loss_reduction,
                                                                     self._notices, evaluating=True))
        return self._evaluation.evaluate(self.plan.microbatches, feed, self._executor)

    def predict(self, *args, **kwargs) -> object:
        """What the model returns (a tensor, tuple, dict, ModelOutput) for `step`'s inputs without target=,
        in eval mode: each tensor the microbatches' concatenated, on the CPU; what the training graph
        does not compute (its own loss, a cache) None (compiler/pipeline/prediction_output.py). Inputs only the
        loss reads (labels) may be left out; a batch smaller than the microbatches (one sample) is
        repeated to fill them. Nothing is updated or counted.

        Args:
            *args: the model's inputs, as `step` takes them (without the target).
            **kwargs: the model's inputs, as `step` takes them.

        Returns:
            The model's output for the batch, of the type the model returns.

        Raises:
            PredictError: the output cannot be rebuilt (a model returning only its loss).
            ModeError: a stage swaps its weights, or the graph fixed training mode.
            ExampleInputsError: inputs not of the compiled form.

        Example:
            >>> pipe.predict(x).shape, pipe.predict(x[:1]).shape
            (torch.Size([8, 5]), torch.Size([1, 5]))
        """
        given = GivenSamples()
        feed = self._feeding.checked(lambda: self._feeding.for_prediction(args, kwargs, given))
        return predict(self._evaluation, self.plan.microbatches, feed, self._executor, lambda: given.count)

    def save(self, directory, scheduler=None, extra: dict | None = None, asynchronous: bool = False) -> SaveHandle:
        """Write a checkpoint to `directory` (layout: compiler/elastic/load.py): the weights and the
        optimizer state by the model's names in torch.distributed.checkpoint, the plan and each
        stage's code as data; `scheduler`'s state and `extra` (metadata) if given. `sw.load` reads it
        back on this plan, `pipe.restore` into a pipeline of the same model on any devices.

        Complete or absent: written beside `directory` and renamed into place, replacing an earlier
        checkpoint only once finished. Under torch.distributed every rank calls save and writes its
        own stages' tensors in parallel; every rank returns once the checkpoint is in place (or
        raises the same failure, leaving an earlier one intact). Across machines `directory` must be
        on a filesystem every rank shares. A pipeline whose failed step could not be undone raises
        PipelineBrokenError instead. `asynchronous=True` returns once this process's state is copied to
        CPU memory and writes on a thread while `step` goes on (rules: compiler/checkpoint/async_save.py).

        Args:
            directory: the checkpoint's folder (a str or Path); an earlier checkpoint there is replaced.
            scheduler: a learning-rate scheduler over `optimizer` whose state to keep.
            extra: metadata to keep (plain Python values), `pipe.extra` after `sw.load`.
            asynchronous: whether to return before the files are written.

        Returns:
            A `SaveHandle`; a synchronous save's is done already.

        Raises:
            CheckpointError: the folder holds something that is not a stagewise checkpoint, or the
                write failed (an earlier checkpoint there stays intact).
            OptionError: a path that cannot be a checkpoint folder, or `asynchronous` not a bool.
            PipelineBrokenError: a failed step could not be undone.

        Example:
            >>> pipe.save(tmp / "checkpoint", extra={"epoch": 3}).done()
            True
            >>> sw.load(tmp / "checkpoint").extra
            {'epoch': 3}
        """
        check_flags(asynchronous=asynchronous)
        directory = save_path(directory)
        self._saves.settle()  # before the step count and the learning rates are read
        self._executor.settle()
        training = training_state(scheduler, extra)
        if self._optimizer is not None:
            self._optimizer.push_hyperparameters()  # the learning rates the scheduler set since the last step
        settings = {**training.settings(), "loss_reduction": reduction_to_data(self.loss_reduction),
                    "mode_training": self.training, "padding": padding_to_data(self._feeding.padding),
                    "acceleration": dataclasses.asdict(self._runtime.acceleration),
                    MODEL_GRAPH: self._model_graph}
        return self._saves.save(self.plan, self._runtime, directory, self._unheld, settings, asynchronous)

    def wait_for_save(self) -> None:
        """Until the save in flight is in place (under torch.distributed: before destroying the group).

        Raises:
            CheckpointError: the asynchronous save failed (unless its handle's `wait` raised it).

        Example:
            >>> handle = pipe.save(tmp / "background", asynchronous=True)
            >>> pipe.wait_for_save()
            >>> handle.done()
            True
        """
        self._saves.settle()

    def resize(self, devices) -> None:
        """Run the same plan (its virtual devices, `compile(virtual_devices=V)`) on the physical
        `devices` from the next step on, bitwise as before; one process (compiler/pipeline/virtual_devices.py).

        Args:
            devices: the physical devices, in any form compile takes.

        Raises:
            DeviceError: devices that do not resolve.
            CapacityError: a device cannot hold the virtual devices placed on it.
            OptionError: under torch.distributed (restart the job and `restore` instead).

        Example:
            >>> pipe.resize(["cpu"])  # both planned devices on one CPU device
            >>> pipe.step(x, target=y).shape
            torch.Size([])
            >>> pipe.resize(["cpu", "cpu"])
        """
        resize(self, devices)

    def _rebuild(self, plan: Plan, runtime: Runtime, unheld: dict[str, torch.Tensor]) -> None:
        """Go on with another runtime of this pipeline's plan (what `resize` made)."""
        compiled = Compiled(self._sim_cost, self._compile_times) if self._sim_cost is not None else None
        model_graph, notices = self._model_graph, self._notices
        self.__init__(plan, runtime, compiled, unheld)  # type: ignore[misc]
        self._model_graph, self._notices = model_graph, notices

    def restore(self, directory, report: bool = True, training_state: bool = True) -> Move:
        """Train on from the checkpoint at `directory`, saved by a pipeline of this model on any devices
        and split (Varuna's job morphing): weights and, unless not `training_state` (fine-tuning from
        it), optimizer state, step count, scheduler state and `extra` (`pipe.load_scheduler`). Returns
        what moved, printed (rank 0) where the plan differs, unless not `report`. A collective.

        Args:
            directory: a checkpoint `pipe.save` wrote.
            report: whether to print what moved where the plan differs.
            training_state: whether to restore the optimizer state, step count and scheduler too.

        Returns:
            The `Move`: the plans before and after, and the bytes each device read.

        Raises:
            CheckpointError: the checkpoint is missing, damaged, or of another model.
            OptionError: `report` or `training_state` is not a bool.

        Example:
            >>> _ = pipe.save(tmp / "to_restore")
            >>> move = pipe.restore(tmp / "to_restore", report=False)
            >>> type(move).__name__
            'Move'
        """
        check_flags(report=report, training_state=training_state)
        self._saves.settle()  # a save in flight uses the same collectives (and may write `directory`)
        return restore_into(self, checkpoint_path(directory, "pipe.restore"), report, training_state)

