"""compile_stages= and cuda_graphs=: where they cannot apply, refused with an OptionError naming the
fix (runtime/stage_calls.py, compiler/assembly/stage_acceleration.py). The GPU runs of cuda_graphs
are in tests/test_cuda.py; a compiled pipeline's training in tests/test_compiled_stages.py."""

import contextlib

import pytest
import torch
import torch.nn.functional as F

import stagewise as sw
from stagewise.compiler.assembly.stage_acceleration import check_plan
from stagewise.runtime import stage_calls
from stagewise.runtime.stage_calls import Acceleration, GraphedStage
from tests.models.mlp import mlp

GRAPHS = Acceleration(cuda_graphs=True)


def _pipe(model: torch.nn.Module, **options: object) -> sw.Pipeline:
    x, y = torch.randn(8, 8), torch.randint(0, 5, (8,))
    options = {"schedule": "1f1b", **options}
    return sw.compile(model, 2, (x,), loss_fn=F.cross_entropy, example_target=y, microbatches=2, cost="analytic",
                      **options)


@pytest.mark.parametrize("options, says", [
    (dict(cuda_graphs=True), "device 'cpu' is not a CUDA device"),
    (dict(training=sw.TrainingOptions(cuda_graphs=True)), "device 'cpu' is not a CUDA device"),
    (dict(compile_stages=True, cuda_graphs=True), "give one"),
])
def test_cuda_graphs_are_refused_on_cpu_devices_and_beside_compile_stages(options, says):
    with pytest.raises(sw.OptionError, match=says):
        _pipe(mlp(), **options)


@pytest.mark.parametrize("flag", ["compile_stages", "cuda_graphs"])
def test_the_flags_are_bools(flag):
    with pytest.raises(sw.OptionError, match=f"{flag}='yes' must be True or False"):
        sw.TrainingOptions(**{flag: "yes"})
    with pytest.raises(sw.OptionError, match=f"{flag}=1 must be True or False"):
        _pipe(mlp(), **{flag: 1})


def test_a_plan_that_swaps_is_refused_for_cuda_graphs():
    """A graph reads the memory it was captured with: swapped weights come back elsewhere."""
    pipe = _pipe(mlp(), swap="on")
    with pytest.raises(sw.OptionError, match=r"moves stage \d+'s state or stash between host and device memory"):
        check_plan(GRAPHS, pipe.plan, pipe.stages)
    check_plan(Acceleration(compile_stages=True), pipe.plan, pipe.stages)  # compiled stages swap


@pytest.mark.parametrize("option", ["cuda_graphs", "compile_stages"])
def test_a_split_backward_is_refused_for_either_option(option):
    """zb-h1 runs a stage's backward in two halves; a graph replays it whole, and torch.compile's
    backward donates its buffers (a second call raised at the first step, rolled back)."""
    pipe = _pipe(mlp(), schedule="zb-h1")
    with pytest.raises(sw.OptionError, match=rf"{option}=True .* splits stage \d+'s into input and weight gradients"):
        check_plan(Acceleration(**{option: True}), pipe.plan, pipe.stages)
    with pytest.raises(sw.OptionError, match="schedule zb-h1"):
        _pipe(mlp(), schedule="zb-h1", compile_stages=True)


def test_keyed_dropout_is_refused_for_cuda_graphs():
    """A replay would draw the captured step's mask again: the key is seeded on the host per step."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.1), torch.nn.Linear(16, 5))
    pipe = _pipe(model, split_points=["2"])
    with pytest.raises(sw.OptionError, match="stage 0's random op '_1' with the mask of the step it was captured in"):
        check_plan(GRAPHS, pipe.plan, pipe.stages)
    plain = _pipe(mlp())
    check_plan(GRAPHS, plain.plan, plain.stages)  # no random op, nothing moved: graphs apply


def test_a_graphed_microbatch_keeps_its_shape_without_buckets():
    """The first shape of a microbatch runs eagerly and waits to be captured; another shape of the same
    microbatch is refused without shape_buckets, and taken with them (each bucket captured once)."""
    module = torch.nn.Linear(4, 2)
    fixed = GraphedStage(module, stage=0, precision="fp32", bucketed=False)
    fixed(module, 0, [torch.randn(3, 4)])
    fixed(module, 1, [torch.randn(2, 4)])  # an uneven last microbatch is another microbatch
    assert len(fixed.pending) == 2
    with pytest.raises(sw.OptionError, match=r"microbatch 0 at input shapes \[\[3, 4\]\].*\[\[5, 4\]\].*shape_buckets"):
        fixed(module, 0, [torch.randn(5, 4)])
    bucketed = GraphedStage(module, stage=0, precision="fp32", bucketed=True)
    bucketed(module, 0, [torch.randn(3, 4)])
    bucketed(module, 0, [torch.randn(5, 4)])
    assert len(bucketed.pending) == 2


def test_a_graphed_stage_runs_other_calls_eagerly():
    """Evaluation (no grad, eval mode) and predict's copy of the module never touch the graphs."""
    module, other = torch.nn.Linear(4, 2), torch.nn.Linear(4, 2)
    graphed = GraphedStage(module, stage=0, precision="fp32", bucketed=False)
    x = torch.randn(3, 4)
    with torch.no_grad():
        torch.testing.assert_close(graphed(module, 0, [x]), module(x))
    torch.testing.assert_close(graphed(other, 0, [x]), other(x))
    module.eval()
    graphed(module, 0, [torch.randn(5, 4)])
    assert not graphed.pending


def test_a_failed_capture_is_an_option_error_naming_the_stage(monkeypatch):
    """An op CUDA graphs cannot hold (one that waits for the host) fails the capture: said as an
    OptionError naming the stage, before the step runs (here the capture's failure is simulated)."""
    def refusing(*args, **kwargs):
        raise RuntimeError("CUDA error: operation not permitted when stream is capturing")

    monkeypatch.setattr(torch.cuda, "make_graphed_callables", refusing)
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    module = torch.nn.Linear(4, 2)
    graphed = GraphedStage(module, stage=3, precision="fp32", bucketed=False)
    graphed(module, 0, [torch.randn(3, 4)])
    with pytest.raises(sw.OptionError, match="could not capture stage 3's forward and backward.*not permitted"):
        graphed.capture_pending()
    assert not graphed.pending and not graphed.graphs


def test_graphs_are_dropped_where_the_weights_moved(monkeypatch):
    """A graph reads the weights' memory at capture: where they moved (a tensor put in place of one),
    the graphs go before the next step, and the step after captures them again (capture counted here)."""
    captured = []
    monkeypatch.setattr(stage_calls, "_capture", lambda module, sample, precision: captured.append(sample) or module)
    module = torch.nn.Linear(4, 2)
    graphed = GraphedStage(module, stage=0, precision="fp32", bucketed=False)
    x = torch.randn(3, 4)
    graphed(module, 0, [x])
    graphed.capture_pending()
    assert len(graphed.graphs) == 1 and len(captured) == 1
    with torch.no_grad():
        module.weight.copy_(torch.ones(2, 4))  # in place: the graph stays
    graphed.capture_pending()
    assert len(graphed.graphs) == 1
    module.weight.data = torch.zeros(2, 4)  # elsewhere: dropped, run eagerly and captured again
    graphed.capture_pending()
    assert not graphed.graphs
    torch.testing.assert_close(graphed(module, 0, [x]), module(x))
    graphed.capture_pending()
    assert len(graphed.graphs) == 1 and len(captured) == 2
