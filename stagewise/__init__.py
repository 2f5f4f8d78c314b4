"""stagewise: compile one PyTorch model into a pipeline that trains across several devices.

    import stagewise as sw
    pipe = sw.compile(model, devices=4, example_inputs=(x,), loss_fn=F.cross_entropy, example_target=y)
    loss = pipe.step(x, target=y)
"""

from stagewise.compiler.checkpoint import load
from stagewise.compiler.checkpoint_async import SaveHandle
from stagewise.compiler.driver import compile, plan, simulate  # noqa: A004 - the public name of the API
from stagewise.compiler.loss_reduction import SampleMean, TokenMean
from stagewise.compiler.optimizer_groups import ParamGroups
from stagewise.compiler.periodic_checkpoint import Checkpoints
from stagewise.compiler.pipeline import Pipeline
from stagewise.compiler.probe import probe_accelerator
from stagewise.compiler.recommend import recommend
from stagewise.compiler.recommend_report import Candidate, Recommendation
from stagewise.ir.catalogue import Catalogue
from stagewise.ir.catalogue_file import load_catalogue
from stagewise.ir.choices import CostModel, Schedule
from stagewise.ir.device_request import Cluster, parse_device_request
from stagewise.ir.devices import Device
from stagewise.ir.errors import (
    AssumedFiguresWarning,
    BatchSizeError,
    CapacityError,
    CheckpointError,
    DeviceError,
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

__all__ = [
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
    "ExampleInputsError",
    "LossError",
    "LossScaling",
    "ModeError",
    "OptionError",
    "OversubscribedWarning",
    "IdleDevicesWarning",
    "AssumedFiguresWarning",
    "ParamGroups",
    "PartitionError",
    "PeerError",
    "Pipeline",
    "PipelineBrokenError",
    "Plan",
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
