"""Errors and warnings a user can cause. Each message names the problem and what to do about it."""


class StagewiseError(Exception):
    """Base class of every error stagewise raises for bad input or an impossible request; catch it
    to handle them all. Each message names the problem and the fix (docs/guide/errors.md lists them).

    Example:
        >>> try:
        ...     sw.Device("cpu", memory=0)
        ... except sw.StagewiseError as error:
        ...     print(type(error).__name__)
        DeviceError
    """


class DeviceError(StagewiseError):
    """Raised by `sw.Device`, `compile`, `plan` and `load` for no devices, an unknown device string,
    a device list of the wrong type, or a size, rate or speed that does not parse or is not
    positive: fix the `devices=` argument as the message says. Also raised by the catalogue
    (`sw.load_catalogue`, `sw.parse_device_request`, `sw.Topology`) for a name, file entry or link
    it cannot use."""


class ExampleInputsError(StagewiseError):
    """Raised by `compile` (and `step`, `evaluate`, `predict`) when `example_inputs` or a step's
    inputs are not of the supported form: give a tuple (positional) or a dict (keyword) of tensors,
    in the form compile was given."""


class TraceError(StagewiseError):
    """Raised by `compile` and `plan` when neither torch.fx nor torch.export can capture the model;
    the message shows both reasons. Replace Python control flow that depends on tensor values with
    tensor operations (`torch.where`) or `torch.cond`."""


class ProfileError(StagewiseError):
    """Raised by `compile` when a layer cannot be profiled (it fails on synthetic inputs, or shapes do
    not propagate through the graph) and by `sw.probe_accelerator(model=)` for a model with no
    counted FLOPs; the message names the layer or what to change."""


class BatchSizeError(StagewiseError):
    """Raised by `compile` and `step` when the batch cannot be split into the requested
    microbatches or is larger than the batch compile planned for: give fewer microbatches or a
    smaller batch, or compile with example inputs of the largest batch."""


class PartitionError(StagewiseError):
    """Raised by `compile` and `plan` when the model cannot be cut into the requested stages (too few
    legal cuts, bad `split_points`): give fewer devices or stages, or other split points."""


class LossError(StagewiseError):
    """Raised by `compile` when the model's output is not a scalar loss and no `loss_fn` was given, a
    `loss_fn` comes without `example_target` (or the reverse), the loss depends on no trainable
    parameter, or `loss_reduction` is not a `sw.TokenMean` / `sw.SampleMean` whose labels it
    can read."""


class PlanError(StagewiseError):
    """Raised when a plan or its programs are inconsistent or cannot be executed (a saved plan that
    does not check, or no plan that fits): the base of `OptionError` and `CheckpointError`."""


class OptionError(PlanError):
    """Raised by `compile`, `plan`, `load` and the pipeline's methods when an argument has the wrong
    type or a value out of range; the message names the argument and the values it takes (a
    PlanError, as the unknown-schedule and replica checks that came first)."""


class CheckpointError(PlanError):
    """Raised by `pipe.save`, `sw.load`, `pipe.restore` and `sw.Checkpoints` for a checkpoint
    directory that cannot be written (the target holds something else) or read (a file missing,
    truncated or corrupted): choose another folder, or restore the checkpoint from a good copy (a
    PlanError, as the missing-plan check that came first)."""


class UntrustedCodeError(CheckpointError):
    """Raised by `sw.load` and `stagewise inspect` when a checkpoint names a function, class or op
    that is neither on stagewise's allowlist (codegen/allowlist.py) nor among the caller's trusted
    functions: loading it would run code the checkpoint chose. The fix is to pass it in
    `trusted_functions` if one trusts it."""


class StateDictError(StagewiseError):
    """Raised by `pipe.load_state_dict` when the state_dict has a key the model lacks, lacks one
    (strict), or holds a tensor of another shape than the model's under some key; nothing was
    copied. Give the model's own names (`pipe.state_dict()`), or `strict=False` for a partial one."""


class CapacityError(StagewiseError):
    """Raised by `compile` when a device's memory pool would exceed the capacity given with
    `sw.Device(..., memory=)` (no plan fits): give more memory, more devices, or `swap=`."""


class PeerError(StagewiseError):
    """Raised by `step` when another device (thread or process) failed or stopped answering: the
    message names the device and its error."""


class StepFailedError(StagewiseError):
    """Raised by `step` when a peer (another rank) failed this step: every rank rolled the step back
    and may train on, for instance by retrying the step."""


class StepTimeoutError(StagewiseError):
    """Raised by `step` when an instruction of this process outlasted the step's deadline
    (`pipe.timeout_s`): raise the deadline, or look for the stage that hangs."""


class PipelineBrokenError(StagewiseError):
    """Raised by `step` (and the methods after it) when a failed step could not be undone (or a stuck
    stage is still running user code): the pipeline refuses to train on; reload it from a
    checkpoint (`sw.load`, `pipe.restore`) or compile again."""


class ModeError(StagewiseError):
    """Raised by `pipe.train`, `eval`, `evaluate` and `predict` for a train/eval mode or a
    forward-only pass the pipeline cannot run (the graph fixed the mode at compile, a stage swaps
    its weights), and by `step` under `torch.no_grad()`, where no training step may run."""


class OversubscribedWarning(UserWarning):
    """Warned by `compile` when in-process CPU devices would run more intra-op threads than the
    machine has cores: call `torch.set_num_threads(cores // devices)` first, or run one process
    per device under torchrun."""


class UnweightedLossWarning(UserWarning):
    """Warned once by `step` when its targets hold ignored entries (-100) but no loss reduction says
    how the loss counts them: the step's loss is the mean of microbatch means, unlike eager's on
    the whole batch. Pass `loss_reduction=sw.TokenMean()` (or `sw.SampleMean()`) to compile."""


class SkippedUpdateWarning(UserWarning):
    """Warned by `step` when its gradients held an inf or NaN, so no stage updated
    (`pipe.skipped_steps` counts them); under fp16 loss scaling a few are expected, many mean
    the loss or learning rate diverged."""


class IdleDevicesWarning(UserWarning):
    """Warned by `sw.load(..., replan=False)` and `pipe.resize` when a saved plan is placed on more
    devices than it has: some stay idle; load with `replan=True` to use them."""


class AssumedFiguresWarning(UserWarning):
    """Warned by `sw.plan` for a GPU described without `peak_flops`: its predicted times rest on an
    assumed rate; give `sw.Device(..., peak_flops=)` or a catalogue request ('8xH100')."""


class DoesNotFitWarning(UserWarning):
    """Warned by `compile` and `sw.plan` when the plan asked for (schedule and microbatches given,
    nothing searched) is predicted to need more memory than a device or host has: its first step
    will fail with a CapacityError. Let the planner search (`schedule="auto"`), swap, recompute
    (`activations=`) or add devices."""


class PrecisionError(StagewiseError):
    """Raised by `compile` for a precision it cannot train in (an unknown name, weights that are not
    fp32 masters) and by `step` under `torch.autocast`: pass `precision=` to compile instead."""


class PredictError(StagewiseError):
    """Raised by `pipe.predict` when the model's output cannot be rebuilt: a checkpoint that does not
    record its structure or is damaged (compile again, or save again from a compiled pipeline), or
    an output type this process does not know (import the module defining it first)."""
