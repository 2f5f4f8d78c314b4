"""Bad input gets a StagewiseError subclass whose message names the problem and the fix."""

import os
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import stagewise as sw
from tests.models.gpt import TinyGPT, lm_loss
from tests.models.mlp import mlp
from tests.models.untraceable import DataDependent

X, Y = torch.randn(8, 8), torch.randint(0, 5, (8,))


def compile_mlp(devices=2, **kwargs):
    kwargs.setdefault("loss_fn", F.cross_entropy)
    kwargs.setdefault("example_target", Y)
    return sw.compile(mlp(), devices, kwargs.pop("example_inputs", (X,)), **kwargs)


@pytest.mark.parametrize("devices", [0, [], -1])
def test_no_devices(devices):
    with pytest.raises(sw.DeviceError, match="at least one device"):
        compile_mlp(devices)


def test_unknown_device_string():
    with pytest.raises(sw.DeviceError, match="unknown device 'tpu:0'.*use 'cpu'"):
        compile_mlp(["cpu", "tpu:0"])


def test_cuda_device_without_cuda():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(sw.DeviceError, match="CUDA but this machine has none"):
        compile_mlp(["cuda:0"])


def test_bad_memory_size():
    with pytest.raises(sw.DeviceError, match="512MiB"):
        sw.Device("cpu", memory="lots")


@pytest.mark.parametrize("bad", [X, [X], "x"])
def test_example_inputs_of_wrong_type(bad):
    with pytest.raises(sw.ExampleInputsError, match="tuple of positional arguments or a dict"):
        compile_mlp(example_inputs=bad)


def test_untraceable_model_reports_both_tracers():
    with pytest.raises(sw.TraceError) as info:
        sw.compile(DataDependent(), 2, (X[:, :4],))
    message = str(info.value)
    assert "torch.fx" in message and "torch.export" in message
    assert "control flow" in message and "What to do" in message


def test_batch_not_divisible():
    with pytest.raises(sw.BatchSizeError, match="batch size 8 is not divisible by microbatches=3.*1, 2, 4, 8"):
        compile_mlp(microbatches=3)


def test_step_with_a_larger_batch_than_planned():
    """A smaller batch trains (tests/test_any_shape.py); a larger one would outgrow the planned memory."""
    pipe = compile_mlp(microbatches=2)
    with pytest.raises(sw.BatchSizeError, match="compiled for 2 microbatches of 4 .a batch of at most 8"):
        pipe.step(torch.randn(10, 8), target=torch.randint(0, 5, (10,)))


def test_more_devices_than_cuts():
    model = nn.Sequential(nn.Linear(8, 5))
    with pytest.raises(sw.PartitionError, match="only 0 legal cut-points.*at most 1 devices"):
        sw.compile(model, 2, (X,), loss_fn=F.cross_entropy, example_target=Y)


def test_split_point_that_does_not_exist():
    with pytest.raises(sw.PartitionError, match="'blocks.9'.*not a layer boundary.*e.g. one of: tok"):
        sw.compile(TinyGPT(), 2, (torch.randint(0, 64, (4, 8)),), loss_fn=lm_loss,
                   example_target=torch.randint(0, 64, (4, 8)), split_points=["blocks.9"])


def test_split_point_at_illegal_cut():
    class ShapeCrossing(nn.Module):
        """A Python int (the batch size) crosses between `a` and `b`: no stage may begin at `b`."""

        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 5)

        def forward(self, x):
            n = x.size(0)
            return self.b(self.a(x)).reshape(n, -1)

    with pytest.raises(sw.PartitionError, match="cannot cut before 'b': non-tensor values cross it"):
        sw.compile(ShapeCrossing(), 2, (X,), loss_fn=F.cross_entropy, example_target=Y, split_points=["b"])


def test_split_points_count_must_match_devices():
    with pytest.raises(sw.PartitionError, match="split_points gives 2 stages but 3 devices with schedule 'gpipe' need 3; give 2 split points"):
        compile_mlp(3, split_points=["2"])


def test_output_not_a_loss_without_loss_fn():
    with pytest.raises(sw.LossError, match=r"output has shape \[4, 5\] \(for one microbatch\), not a scalar loss: pass loss_fn"):
        sw.compile(mlp(), 2, (X,))


def test_step_without_target():
    pipe = compile_mlp()
    with pytest.raises(sw.ExampleInputsError, match="target="):
        pipe.step(X)


def test_step_with_inputs_in_another_form():
    pipe = compile_mlp()
    with pytest.raises(sw.ExampleInputsError, match="1 positional inputs"):
        pipe.step(x=X, target=Y)


def test_unknown_schedule():
    with pytest.raises(sw.PlanError, match="unknown schedule 'zigzag'"):
        compile_mlp(schedule="zigzag")


def test_errors_are_stagewise_errors():
    for cls in (sw.DeviceError, sw.ExampleInputsError, sw.TraceError, sw.BatchSizeError, sw.PartitionError,
                sw.LossError, sw.PlanError):
        assert issubclass(cls, sw.StagewiseError)


def test_in_process_cpu_devices_that_oversubscribe_the_cores_warn(monkeypatch):
    """Each device's compute thread runs torch's intra-op threads: more than the cores is a warning
    that names the thread count to set."""
    cores = len(os.sched_getaffinity(0))
    monkeypatch.setattr(torch, "get_num_threads", lambda: cores + 1)  # more than the cores on any machine
    with pytest.warns(sw.OversubscribedWarning, match=rf"torch.set_num_threads\({max(1, cores // 2)}\)"):
        compile_mlp(2, cost="analytic")
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)  # nothing to gain, even with more devices than cores
    with warnings.catch_warnings():
        warnings.simplefilter("error", sw.OversubscribedWarning)
        compile_mlp(3, cost="analytic")


def _subclasses(cls: type) -> set[type]:
    return {sub for direct in cls.__subclasses__() for sub in {direct, *_subclasses(direct)}}


def test_every_error_and_warning_class_is_exported():
    """A user catches what stagewise raises by its public name: every StagewiseError subclass and
    every warning class ir/errors.py defines is in `stagewise.__all__` (the command line's own error
    class, cli/errors.py, is the command's, not the API's)."""
    from stagewise.ir import errors

    defined = {cls for cls in vars(errors).values() if isinstance(cls, type) and cls.__module__ == errors.__name__}
    raised = {cls for cls in _subclasses(sw.StagewiseError) if cls.__module__ == errors.__name__}
    warned = {cls for cls in defined if issubclass(cls, Warning)}
    assert raised and warned and raised | warned | {sw.StagewiseError} == defined
    missing = sorted(cls.__name__ for cls in raised | warned | {sw.StagewiseError}
                     if cls.__name__ not in sw.__all__ or getattr(sw, cls.__name__, None) is not cls)
    assert not missing, f"not exported from stagewise: {missing}"
