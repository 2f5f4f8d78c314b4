"""What a checkpoint keeps of the training loop besides the pipeline: the LR scheduler's state
and the user's metadata (`pipe.save(directory, scheduler=..., extra={...})`), and putting the
scheduler back after `sw.load`.

Making a torch scheduler over an optimizer overwrites its groups' learning rates (torch says to
make it before `optimizer.load_state_dict`), but `sw.load` has already loaded the optimizer: so
`Pipeline.load_scheduler` loads the scheduler's saved state and then puts back the learning
rates the checkpoint's optimizer had, which are still in the stages' optimizers (the view's
groups reach them only at the next step).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from stagewise.compiler.assembly.plain_values import same_kind
from stagewise.compiler.checkpoint.write import serialised
from stagewise.compiler.pipeline.optimizer_view import PipelineOptimizer
from stagewise.ir.errors import CheckpointError, OptionError

if TYPE_CHECKING:
    from stagewise.compiler.pipeline.pipeline import Pipeline


@dataclass
class TrainingState:
    """A loaded pipeline's part of its checkpoint for the training loop."""

    scheduler_state: dict | None = None  # scheduler.state_dict() as saved, if a scheduler was given
    extra: dict = field(default_factory=dict)  # the user's metadata
    loaded_at_step: int = 0  # the executor's step count when loaded

    def settings(self) -> dict:
        """The entries runtime.pt stores (read back by `from_settings`)."""
        return {"scheduler": self.scheduler_state, "extra": self.extra}

    @classmethod
    def from_settings(cls, settings: dict) -> TrainingState:
        return cls(settings.get("scheduler"), dict(settings.get("extra") or {}), settings.get("step", 0))


def put_saved_mode(pipe: Pipeline, settings: dict) -> None:
    """The mode a loaded pipeline was saved in (train, or eval: pipe.eval() before pipe.save)."""
    mode = settings.get("mode_training")
    if mode is not None and mode != pipe.training:
        pipe.train(mode)


def training_state(scheduler: object, extra: object) -> TrainingState:
    """What `pipe.save(directory, scheduler=, extra=)` stores, checked: a scheduler with
    state_dict(), metadata a dict of plain values (a safe load reads them back)."""
    if extra is not None and not isinstance(extra, dict):
        raise OptionError(f"pipe.save(extra=...) takes a dict of metadata, got {type(extra).__name__}")
    state = None
    if scheduler is not None:
        state_dict = getattr(scheduler, "state_dict", None)
        if not callable(state_dict):
            raise OptionError(f"pipe.save(scheduler=...) takes a torch.optim.lr_scheduler made over pipe.optimizer, "
                              f"got {type(scheduler).__name__}")
        state = state_dict()
    try:
        serialised((state, extra))
    except CheckpointError as err:
        raise OptionError(f"pipe.save could not store the scheduler's state or extra= ({err.__cause__}): give plain "
                          "values (numbers, strings, tensors, lists and dicts of them)") from None
    return TrainingState(state, dict(extra or {}))


def resume_scheduler(optimizer: PipelineOptimizer, scheduler: object, training: TrainingState, step: int) -> None:
    """Load the checkpoint's scheduler state into `scheduler` (made over `optimizer` after
    `sw.load`) and put back the checkpoint's learning rates, which making it overwrote."""
    if training.scheduler_state is None:
        raise CheckpointError("this pipeline holds no saved scheduler state: save with pipe.save(directory, "
                              "scheduler=scheduler), load with stagewise.load, then call pipe.load_scheduler")
    if step != training.loaded_at_step:
        raise CheckpointError("pipe.load_scheduler must come right after stagewise.load and making the scheduler, "
                              "before pipe.step: a step since used the learning rates the new scheduler set")
    if getattr(scheduler, "optimizer", None) is not optimizer:
        raise OptionError("pipe.load_scheduler takes a scheduler made over pipe.optimizer")
    own = scheduler.state_dict()  # type: ignore[attr-defined]
    foreign = {k: v for k, v in training.scheduler_state.items() if k not in own or not same_kind(v, own[k])}
    if foreign:  # load_state_dict sets each entry as an attribute of the scheduler
        raise CheckpointError(f"the checkpoint's scheduler state gives {repr(foreign)[:120]}, which this "
                              f"{type(scheduler).__name__} does not have or holds as another kind: load it into the "
                              "scheduler class it was saved with")
    scheduler.load_state_dict(training.scheduler_state)  # type: ignore[attr-defined]
    optimizer.pull_hyperparameters()
