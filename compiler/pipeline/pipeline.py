"""The compiled pipeline: what `stagewise.compile` returns and `stagewise.load` restores."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from stagewise.compiler.assembly.loss_reduction import LossReduction, check_loss_reduction, reduction_to_data
from stagewise.compiler.assembly.options import check_flags
from stagewise.compiler.assembly.runtime_setup import Runtime
from stagewise.compiler.assembly.state_dict import IncompatibleKeys, aliases_of, check_state_dict
from stagewise.compiler.assembly.step_shapes import StepShapes, TransferSpecs
from stagewise.compiler.checkpoint.arguments import checkpoint_path, save_path
from stagewise.compiler.checkpoint.async_save import SaveHandle, SaveSlot
from stagewise.compiler.checkpoint.write import MODEL_GRAPH
from stagewise.compiler.pipeline.evaluation import Evaluation
from stagewise.compiler.pipeline.morph import Move, restore_into
from stagewise.compiler.pipeline.optimizer_view import PipelineOptimizer
from stagewise.compiler.pipeline.prediction import predict, prediction_pieces
from stagewise.compiler.pipeline.small_batches import GivenSamples, filled
from stagewise.compiler.pipeline.step_inputs import prepare_batch, training_inputs
from stagewise.compiler.pipeline.step_notices import StepNotices
from stagewise.compiler.pipeline.token_ids import check_token_ids, embedding_bounds
from stagewise.compiler.pipeline.training_state import TrainingState, resume_scheduler, training_state
from stagewise.compiler.pipeline.virtual_devices import resize
from stagewise.ir.errors import ModeError, PrecisionError
from stagewise.ir.instructions import Stream
from stagewise.ir.plan import Plan, SharedTensor
from stagewise.ir.program import Program
from stagewise.passes.costs import plan_charges
from stagewise.passes.simulate import SimCost, SimResult, simulate
from stagewise.runtime.distributed import DistributedTransport
from stagewise.runtime.executor import DEFAULT_TIMEOUT_S, StreamExecutor
from stagewise.runtime.launch import DistributedContext
from stagewise.runtime.precision import enclosing_autocast
from stagewise.runtime.worker import StageWorker


@dataclass(frozen=True)
class Compiled:
    """What compiling found beside the plan (a loaded pipeline has none): the planner's per-stage
    costs of the chosen plan (`pipe._sim_cost`, for benches and tests that vary them), the seconds
    each compile phase took (`pipe.compile_times`), and the loss reduction compile was given."""

    sim_cost: SimCost
    phase_seconds: dict[str, float] = field(default_factory=dict)
    loss_reduction: LossReduction | None = None
    model_graph: dict | None = None  # what checkpoints keep to plan again (compiler/compile/model_graph.py)


class Pipeline:
    """Stage modules, their device programs, and the runtime that executes them: what `sw.compile`
    returns and `sw.load` restores, driven like a model and its optimizer in one (`step`). In the
    examples of its methods, `pipe` is `sw.compile(model, ["cpu", "cpu"], (x,),
    loss_fn=F.cross_entropy, example_target=y, microbatches=2)` for a small MLP `model`.

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
        self.plan = plan
        self._runtime = runtime
        # state_dict entries no stage holds (layers the loss never reaches), on the CPU: training
        # leaves them as they are, state_dict returns them and save / load carry them (unused.pt).
        self._unheld = dict(unheld or {})
        self._sim_cost = compiled.sim_cost if compiled is not None else None
        self._compile_times = dict(compiled.phase_seconds) if compiled is not None else {}
        self.timeout_s = DEFAULT_TIMEOUT_S
        self._optimizer: PipelineOptimizer | None = None  # made when first asked for
        self._resumed = TrainingState()  # a loaded pipeline's: the saved scheduler state and `extra`
        self._evaluation = Evaluation(plan, runtime.workers, runtime.pools, runtime.transport)
        self._token_bounds = embedding_bounds(plan, [w.module for w in runtime.workers])  # ids each input may hold
        self._step_shapes = StepShapes(plan, runtime.stage_modules, runtime.stage_states,
                                       [pool.device for pool in runtime.pools])
        self._loss_reduction: LossReduction | None = None
        self._saves = SaveSlot()  # the save in flight (compiler/checkpoint/async_save.py)
        self._notices = StepNotices()  # warnings given once, skipped updates counted (compiler/pipeline/step_notices.py)
        self.loss_reduction = compiled.loss_reduction if compiled is not None else None  # checked
        self._model_graph = compiled.model_graph if compiled is not None else None  # sw.load sets a loaded one's

    # ---- the runtime's parts ---------------------------------------------------------------
    @property
    def context(self) -> DistributedContext | None:
        """This process's rank and world under torch.distributed; None in one process.

        Example:
            >>> pipe.context is None
            True
        """
        return self._runtime.context

    @property
    def _workers(self) -> list[StageWorker]:
        return self._runtime.workers

    @property
    def _executor(self) -> StreamExecutor:
        return self._runtime.executor

    # ---- the public surface -------------------------------------------------------------
    @property
    def compile_times(self) -> dict[str, float]:
        """Seconds each compile phase took, by phase name (capture ... runtime); {} after `sw.load`.

        Example:
            >>> list(pipe.compile_times)
            ['capture', 'analyse', 'cost', 'plan', 'codegen', 'runtime']
        """
        return dict(self._compile_times)

    @property
    def stages(self) -> list[fx.GraphModule]:
        """The generated stage modules this process runs, one GraphModule each (print one's `.code`).

        Example:
            >>> [type(stage).__name__ for stage in pipe.stages]
            ['Stage0', 'Stage1']
        """
        return [w.module for w in self._workers]

    @property
    def programs(self) -> tuple[Program, ...]:
        """The plan's instruction programs, one per device (print one to read it).

        Example:
            >>> [program.device for program in pipe.programs]
            [0, 1]
        """
        return self.plan.programs

    @property
    def shared(self) -> tuple[SharedTensor, ...]:
        """The tensors several stages hold (tied weights), and how their gradients are summed.

        Example:
            >>> pipe.shared  # the MLP ties no weights
            ()
        """
        return self.plan.shared

    @property
    def optimizer(self) -> PipelineOptimizer:
        """The stages' optimizers as one torch.optim.Optimizer over the model (compiler/pipeline/optimizer_view.py):
        a torch.optim.lr_scheduler on it reaches every stage; state_dict() is keyed by the model's names.

        Example:
            >>> isinstance(pipe.optimizer, torch.optim.Optimizer), len(pipe.optimizer.param_groups)
            (True, 1)
        """
        if self._optimizer is None:
            self._optimizer = PipelineOptimizer(self.plan, self._workers, self._executor.settle,
                                                self.context is not None, self._runtime.optimizer_factory)
        return self._optimizer

    @property
    def extra(self) -> dict:
        """The metadata `pipe.save(directory, extra=...)` stored, after `sw.load` ({} otherwise).

        Example:
            >>> _ = pipe.save(tmp / "with_extra", extra={"epoch": 3})
            >>> sw.load(tmp / "with_extra").extra
            {'epoch': 3}
        """
        return self._resumed.extra

    def load_scheduler(self, scheduler) -> None:
        """After `sw.load`: load the scheduler state `pipe.save(directory, scheduler=...)` stored into
        `scheduler` (just made over pipe.optimizer) and put back the learning rates it had, so
        training resumes bitwise (compiler/pipeline/training_state.py).

        Args:
            scheduler: a torch.optim.lr_scheduler made over this pipeline's `optimizer`.

        Example:
            >>> scheduler = torch.optim.lr_scheduler.StepLR(pipe.optimizer, step_size=1, gamma=0.5)
            >>> _ = pipe.save(tmp / "scheduled", scheduler=scheduler)
            >>> loaded = sw.load(tmp / "scheduled")
            >>> resumed = torch.optim.lr_scheduler.StepLR(loaded.optimizer, step_size=1, gamma=0.5)
            >>> loaded.load_scheduler(resumed)
            >>> resumed.state_dict()["last_epoch"] == scheduler.state_dict()["last_epoch"]
            True
        """
        resume_scheduler(self.optimizer, scheduler, self._resumed, self._executor.state.iteration)

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
    def loss_scale(self) -> float | None:
        """fp16's current loss scale (runtime/precision.py); None in fp32 and bf16.

        Example:
            >>> pipe.loss_scale is None  # compiled in fp32
            True
        """
        return None if self._executor.state.scaler is None else self._executor.state.scaler.scale

    @property
    def last_step_skipped(self) -> bool:
        """Whether the last step's gradients held an inf or NaN (seen in the global norm, which fp16 and
        clip_grad_norm compute), so no stage updated (fp16: the scale backed off).

        Example:
            >>> _ = pipe.step(x, target=y)
            >>> pipe.last_step_skipped
            False
        """
        return self._executor.state.last_step_skipped

    @property
    def skipped_steps(self) -> int:
        """How many of this pipeline's steps skipped their update so far (the first one warns).

        Example:
            >>> pipe.skipped_steps
            0
        """
        return self._notices.skipped_steps

    @property
    def last_grad_norm(self) -> float | None:
        """The global gradient norm of the last step, before clipping (as clip_grad_norm_ returns
        it); None without clip_grad_norm.

        Example:
            >>> _ = pipe.step(x, target=y)
            >>> pipe.last_grad_norm is None  # compiled without clip_grad_norm
            True
        """
        return self._executor.state.last_grad_norm

    def time_breakdown(self) -> list[dict[str, float]]:
        """Where the last step's time went, per device (before the first step, every device at zero).

        Returns:
            One dict per device: its index, the step's seconds, and the seconds each stream (compute,
            p2p in and out, swap in and out) was busy.

        Example:
            >>> _ = pipe.step(x, target=y)
            >>> [sorted(row) for row in pipe.time_breakdown()][0]
            ['compute_s', 'device', 'p2p_in_s', 'p2p_out_s', 'step_s', 'swap_in_s', 'swap_out_s']
        """
        timeline = self._executor.state.step.timeline
        step = max((end for *_, end in timeline), default=0.0)
        rows = []
        for program in self._executor.programs:
            busy = dict.fromkeys(Stream, 0.0)
            for device, stream, _, start, end in timeline:
                if device == program.device:
                    busy[stream] += end - start
            rows.append({"device": program.device, "step_s": step, **{f"{s.value}_s": v for s, v in busy.items()}})
        return rows

    @property
    def timeout_s(self) -> float:
        """The step's deadline in seconds (default 300): in one process `step` returns within it (and
        a small margin) whatever a stage does, raising StepTimeoutError naming what stalled. Under
        torch.distributed a device waits this long for a peer before a PeerError naming the rank.

        Example:
            >>> pipe.timeout_s
            300.0
            >>> pipe.timeout_s = 60.0
            >>> pipe.timeout_s
            60.0
            >>> pipe.timeout_s = 300.0
        """
        transport = self._runtime.transport
        return transport.timeout_s if isinstance(transport, DistributedTransport) else self._executor.state.timeout_s

    @timeout_s.setter
    def timeout_s(self, seconds: float) -> None:
        # Across processes the transport's wait names the silent rank: let it expire first.
        transport = self._runtime.transport
        self._executor.state.timeout_s = 2 * seconds if isinstance(transport, DistributedTransport) else seconds
        if isinstance(transport, DistributedTransport):
            transport.timeout_s = seconds

    @property
    def stats(self) -> list[dict[str, int | None]]:
        """Per device, from its memory pool: peak and current bytes (by kind), swap and p2p bytes.
        (`pipe.stats[0]["peak_bytes"]`: device 0's peak.)

        Example:
            >>> [(row["device"], row["peak_bytes"] > 0) for row in pipe.stats]
            [(0, True), (1, True)]
        """
        return [pool.stats() for pool in self._runtime.pools]

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
        _refuse_enclosing_autocast("step")
        if self._optimizer is not None:
            self._optimizer.push_hyperparameters()
        loss = self._executor.run(self.plan.microbatches, feed=self._checked_feed(lambda: self._feeder(args, target, kwargs)))
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
        _refuse_enclosing_autocast("evaluate")
        feed = self._checked_feed(lambda: self._feeder(args, target, kwargs, evaluating=True))
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
        feed = self._checked_feed(lambda: self._prediction_feeder(args, kwargs, given))
        return predict(self._evaluation, self.plan.microbatches, feed, self._executor, lambda: given.count)

    def _checked_feed(self, feeder: Callable[[], Callable[[], None]]) -> Callable[[], None]:
        """The feed of a step, an evaluation or a prediction, from `feeder`, which checks the inputs.
        In one process they are checked now; under torch.distributed when the pass begins, so that
        inputs one rank refuses fail it on every rank at once (the others raise StepFailedError)
        instead of leaving them waiting."""
        if self.context is None:
            return feeder()
        return lambda: feeder()()

    def _prediction_feeder(self, args, kwargs, given: GivenSamples) -> Callable[[], None]:
        """What feeds the workers a prediction's microbatches (compiler/pipeline/prediction.py `prediction_pieces`)."""
        pieces = prediction_pieces(self.plan, self._step_shapes.modules, args, kwargs, given, self._token_bounds)
        return lambda: self._feed(pieces)

    def _feeder(self, args, target, kwargs, evaluating: bool = False):
        """What feeds the workers a minibatch's microbatches, checked as `step` (or `evaluate`, filled) takes them."""
        call = "evaluate" if evaluating else "step"
        inputs = training_inputs(self.plan, args, target, kwargs, call)
        inputs = filled(self.plan, inputs) if evaluating else inputs
        prepared = prepare_batch(self.plan, self._step_shapes, inputs, self.loss_reduction, self._notices, call)
        check_token_ids(inputs, self._token_bounds, call)
        return lambda: self._feed(prepared.pieces, prepared.weights, prepared.transfer_specs)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The trained state under every key of the original model's state_dict, in its order (tied
        names share one tensor; layers no stage holds as they were at compile). Under
        torch.distributed every rank gathers every stage's state. (A broken pipeline's state may be read.)

        Returns:
            {name: tensor}, as the model's `state_dict()` names them.

        Example:
            >>> state = pipe.state_dict()
            >>> list(state)[:3], list(state) == list(model.state_dict())
            (['0.weight', '0.bias', '2.weight'], True)
        """
        self._executor.settle(broken_ok=True)
        found = self._local_state()
        if self.context is not None:
            gathered: list[dict[str, torch.Tensor] | None] = [None] * len(self.plan.devices)
            mine = {k: v.detach().cpu() for k, v in found.items() if k not in self._unheld}  # every rank has those
            torch.distributed.all_gather_object(gathered, mine)
            for part in gathered:
                for name, tensor in (part or {}).items():
                    found.setdefault(name, tensor)
        result = {}
        for name in self.plan.state_names:
            holder = next((n for n in aliases_of(self.plan, name) if n in found), None)
            if holder is not None:
                result[name] = found[holder]
        return result

    def load_state_dict(self, state_dict: Mapping[str, torch.Tensor], strict: bool = True) -> IncompatibleKeys:
        """Copy `state_dict`'s values into the pipeline's state, as torch's `Module.load_state_dict`:
        returns (missing_keys, unexpected_keys); with `strict` either is a StateDictError, and a
        wrongly shaped tensor always is (compiler/assembly/state_dict.py). When it raises nothing is loaded.
        Under torch.distributed every rank calls it with the same state_dict.

        Args:
            state_dict: tensors under the model's names (tied names: any one of them).
            strict: whether a missing or unknown key is an error.

        Returns:
            `IncompatibleKeys(missing_keys, unexpected_keys)`.

        Raises:
            StateDictError: a wrongly shaped tensor, or (strict) a missing or unknown key.
            OptionError: `strict` is not a bool.

        Example:
            >>> pipe.load_state_dict(model.state_dict())
            IncompatibleKeys(missing_keys=[], unexpected_keys=[])
            >>> pipe.load_state_dict({"0.weight": torch.zeros(1)})
            Traceback (most recent call last):
            ...
            stagewise.ir.errors.StateDictError: ...
        """
        check_flags(strict=strict)
        shapes = (dict(zip(self.plan.state_names, self.plan.state_shapes, strict=True)) if self.plan.state_shapes
                  else {n: tuple(t.shape) for n, t in self._local_state().items()})
        result = check_state_dict(self.plan, state_dict, strict, shapes)
        self._executor.settle(broken_ok=True)
        holders = [self._unheld] + [worker.state_tensors() for worker in self._workers]  # every replica of a tie
        with torch.no_grad():
            for held in holders:
                for name, tensor in held.items():
                    source = next((state_dict[a] for a in aliases_of(self.plan, name) if a in state_dict), None)
                    if source is not None:
                        tensor.copy_(source)
        return result

    def simulate(self, peak_flops: float | None = None, bandwidth: float | None = None) -> SimResult:
        """The predicted timeline of one iteration of these programs, with the costs the plan's
        prediction charged (profiled or analytic; the plan keeps them, so a loaded pipeline predicts
        the same), or for other hardware: devices of `peak_flops` FLOP/s (the analytic model's compute
        bound), links of `bandwidth` bytes/s (passes/costs.py `plan_charges`).

        Args:
            peak_flops: every device's FLOP/s, or None for the plan's own costs.
            bandwidth: every link's bytes/s, or None for the plan's own links.

        Returns:
            The `SimResult`: iteration time, per-device busy and idle time, peak memory, timeline.

        Example:
            >>> result = pipe.simulate()
            >>> result.iteration_time > 0, len(result.peak_bytes)
            (True, 2)
        """
        return simulate(self.plan.programs, plan_charges(self.plan, peak_flops, bandwidth))  # as sw.simulate

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
                    "mode_training": self.training, MODEL_GRAPH: self._model_graph}
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

    # ---- helpers --------------------------------------------------------------------------
    def _feed(self, pieces: Sequence[Mapping[str, torch.Tensor | None]], weights: tuple[float, ...] | None = None,
              transfer_specs: TransferSpecs | None = None) -> None:
        """Give each worker its inputs of every microbatch it runs (a failed step clears them), the
        executors each microbatch's loss weight (None: 1 / microbatches), and the transport the sizes
        of what is sent where they are not the plan's (compiler/assembly/step_shapes.py)."""
        self._executor.state.loss_weights.weights = weights
        self._runtime.transport.transfer_specs = transfer_specs
        for worker in self._workers:
            for mb, piece in enumerate(pieces):
                if worker.stage.microbatches and mb not in worker.stage.microbatches:
                    continue
                for name in worker.stage.inputs:
                    if name in piece:
                        worker.provide(mb, name, piece[name])

    def _local_state(self) -> dict[str, torch.Tensor]:
        """This process's state tensors by name: its stages' and the unheld entries."""
        found = dict(self._unheld)
        for worker in self._workers:
            for name, tensor in worker.state_tensors().items():
                found.setdefault(name, tensor)
        return found


def _refuse_enclosing_autocast(call: str) -> None:
    """torch.autocast around a call would be ignored (the stages compute on threads of their own)."""
    kind = enclosing_autocast()
    if kind is not None:
        raise PrecisionError(f"pipe.{call} was called under torch.autocast({kind!r}), which the pipeline's stage "
                             "threads do not see; compile with precision='bf16' (or 'fp16') instead, and call "
                             f"{call} outside autocast")
