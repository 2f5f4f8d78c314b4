"""stagewise: compile one PyTorch model into a pipeline that trains across several devices.

    import stagewise as sw
    pipe = sw.compile(model, devices=4, example_inputs=(x,), loss_fn=F.cross_entropy, example_target=y)
    loss = pipe.step(x, target=y)

Each public name documents itself, with an example that runs (`help(sw.Pipeline)`,
`help(sw.load)`); the guide is docs/guide/ (training, checkpoints, planning, errors).
"""

from stagewise.catalogue.entries import Catalogue
from stagewise.catalogue.files import load_catalogue
from stagewise.catalogue.requests import Cluster, parse_device_request
from stagewise.compiler.advice.probe import probe_accelerator
from stagewise.compiler.advice.recommend import recommend
from stagewise.compiler.advice.recommend_report import Candidate, Recommendation
from stagewise.compiler.assembly.loss_reduction import SampleMean, TokenMean
from stagewise.compiler.assembly.optimizer_groups import ParamGroups
from stagewise.compiler.assembly.option_groups import MemoryOptions, PlanOptions, TrainingOptions
from stagewise.compiler.checkpoint.async_save import SaveHandle
from stagewise.compiler.compile.driver import compile, plan, simulate  # noqa: A004 - the public name of the API
from stagewise.compiler.elastic.load import load
from stagewise.compiler.elastic.periodic import Checkpoints
from stagewise.compiler.pipeline.pipeline import Pipeline
from stagewise.ir.choices import ActivationPolicy, CostModel, Schedule
from stagewise.ir.devices import Device
from stagewise.ir.errors import (
    AssumedFiguresWarning,
    BatchSizeError,
    CapacityError,
    CheckpointError,
    DeviceError,
    DoesNotFitWarning,
    ExampleInputsError,
    IdleDevicesWarning,
    LossError,
    ModeError,
    OptionError,
    OversubscribedWarning,
    PartitionError,
    PeerError,
    PipelineBrokenError,
    PlanError,
    PrecisionError,
    PredictError,
    ProfileError,
    SkippedUpdateWarning,
    StagewiseError,
    StateDictError,
    StepFailedError,
    StepTimeoutError,
    TraceError,
    UntrustedCodeError,
    UnweightedLossWarning,
)
from stagewise.ir.plan import Plan
from stagewise.ir.precision import LossScaling
from stagewise.ir.topology import Topology
from stagewise.passes.swap import SwapMode
from stagewise.runtime.device_time import DeviceTime

__all__ = [
    "ActivationPolicy",
    "BatchSizeError",
    "Candidate",
    "CapacityError",
    "Catalogue",
    "CheckpointError",
    "Checkpoints",
    "CostModel",
    "Cluster",
    "Device",
    "DeviceError",
    "DeviceTime",
    "ExampleInputsError",
    "LossError",
    "LossScaling",
    "MemoryOptions",
    "ModeError",
    "OptionError",
    "OversubscribedWarning",
    "IdleDevicesWarning",
    "AssumedFiguresWarning",
    "DoesNotFitWarning",
    "ParamGroups",
    "PartitionError",
    "PeerError",
    "Pipeline",
    "PipelineBrokenError",
    "Plan",
    "PlanOptions",
    "Schedule",
    "PlanError",
    "PrecisionError",
    "PredictError",
    "ProfileError",
    "Recommendation",
    "SampleMean",
    "SaveHandle",
    "SkippedUpdateWarning",
    "StagewiseError",
    "SwapMode",
    "StateDictError",
    "StepFailedError",
    "StepTimeoutError",
    "TokenMean",
    "Topology",
    "TrainingOptions",
    "TraceError",
    "UnweightedLossWarning",
    "UntrustedCodeError",
    "compile",
    "load",
    "load_catalogue",
    "parse_device_request",
    "plan",
    "probe_accelerator",
    "recommend",
    "simulate",
]
