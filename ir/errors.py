"""Errors and warnings a user can cause. Each message names the problem and what to do about it."""


class StagewiseError(Exception):
    """Base class of every error stagewise raises for bad input or an impossible request."""


class DeviceError(StagewiseError):
    """No devices, an unknown device string, or a device list of the wrong type."""


class ExampleInputsError(StagewiseError):
    """`example_inputs` (or the inputs given to `step`) are not of the supported form."""


class TraceError(StagewiseError):
    """Neither torch.fx nor torch.export could capture the model."""


class ProfileError(StagewiseError):
    """A layer cannot be profiled: it fails on synthetic inputs or does not fit even at u=1."""


class BatchSizeError(StagewiseError):
    """The batch cannot be split into the requested number of equal microbatches."""


class PartitionError(StagewiseError):
    """The model cannot be cut into the requested stages (too few legal cuts, bad split_points)."""


class LossError(StagewiseError):
    """The model's output is not a scalar loss and no `loss_fn` was given."""


class PlanError(StagewiseError):
    """A saved plan or program is inconsistent or cannot be executed."""


class OptionError(PlanError):
    """A compile argument has the wrong type or a value out of range (a PlanError, as the
    unknown-schedule and replica checks that came first)."""


class CheckpointError(PlanError):
    """A checkpoint directory that cannot be written (the target holds something else) or read (a
    file missing, truncated or corrupted); a PlanError, as the missing-plan check that came first."""


class UntrustedCodeError(CheckpointError):
    """A checkpoint names a function, class or op that is neither on stagewise's allowlist
    (codegen/allowlist.py) nor among the caller's trusted functions: loading it would run code
    the checkpoint chose. The fix is to pass it in `trusted_functions` if one trusts it."""


class StateDictError(StagewiseError):
    """A state_dict given to `load_state_dict` has a key the model lacks, lacks one (strict), or
    holds a tensor of another shape than the model's under some key."""


class CapacityError(StagewiseError):
    """A device's memory pool would exceed the capacity given with `sw.Device(..., memory=)`."""


class PeerError(StagewiseError):
    """Another device (thread or process) failed or stopped answering."""


class StepFailedError(StagewiseError):
    """A peer (another rank) failed this step: every rank rolled the step back and may train on."""


class StepTimeoutError(StagewiseError):
    """An instruction of this process outlasted the step's deadline (`timeout_s`)."""


class PipelineBrokenError(StagewiseError):
    """A failed step could not be undone (or a stuck stage is still running user code): the
    pipeline refuses to train on until it is reloaded from a checkpoint or recompiled."""


class ModeError(StagewiseError):
    """A train/eval mode or a forward-only pass the pipeline cannot run (the graph fixed the mode at
    compile, a stage swaps its weights), or a training step asked for where none may run (no_grad)."""


class OversubscribedWarning(UserWarning):
    """In-process CPU devices would run more intra-op threads than the machine has cores."""


class UnweightedLossWarning(UserWarning):
    """A step's targets hold ignored entries (-100) but no loss reduction says how the loss counts
    them: the step's loss is the mean of microbatch means, unlike eager's on the whole batch."""


class SkippedUpdateWarning(UserWarning):
    """A step's gradients held an inf or NaN, so no stage updated (`pipe.skipped_steps` counts them)."""


class IdleDevicesWarning(UserWarning):
    """A saved plan placed on more devices than it has (`sw.load(..., replan=False)`, `pipe.resize`): some stay idle."""


class AssumedFiguresWarning(UserWarning):
    """`sw.plan` for a GPU described without `peak_flops`: its predicted times rest on an assumed rate."""


class PrecisionError(StagewiseError):
    """A precision compile cannot train in: an unknown name, weights that are not fp32 masters,
    or torch.autocast around `step` (say precision= to compile instead)."""


class PredictError(StagewiseError):
    """`pipe.predict` where the model's output is not a known value of the traced graph."""
