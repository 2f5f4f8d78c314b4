"""compile_stages=True: each stage module through torch.compile (inductor, on 2 CPU devices). Not
bitwise (inductor fuses and reorders float ops): within the tolerance the eager-equality tests use
(tests/reference.py RTOL, ATOL), in fp32; dropout draws the masks the pipeline without compile draws.
One compiled pipeline per model serves the file: inductor's compile is the cost (seconds per stage)."""

import copy
import functools
import io

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

import stagewise as sw
from stagewise.passes.capture import trace
from stagewise.passes.layers import build_layers
from stagewise.passes.profile import profile_layers
from stagewise.runtime.stage_calls import Acceleration, CompiledStage
from tests.harness.crafted import quiet_load, reseal
from tests.models.dropout import MaskProbe
from tests.models.mlp import mlp
from tests.reference import ATOL, RTOL, SGD, eager_train, pipeline_train


@pytest.fixture(scope="module")
def trained():
    """tests/models' MLP compiled onto 2 CPU devices and eagerly, 3 steps of one shape; the graphs
    torch.compile made before the first step and after each."""
    generator = torch.Generator().manual_seed(1)
    batches = [((torch.randn(8, 8, generator=generator),), torch.randint(0, 5, (8,), generator=generator))
               for _ in range(3)]
    torch.manual_seed(0)
    model = mlp()
    reference = copy.deepcopy(model)
    want = eager_train(reference, batches, loss_fn=F.cross_entropy, microbatches=2)
    pipe = sw.compile(model, 2, batches[0][0], loss_fn=F.cross_entropy, example_target=batches[0][1], optimizer=SGD,
                      microbatches=2, schedule="1f1b", cost="analytic", compile_stages=True)
    graphs = [counters["stats"]["unique_graphs"]]
    losses = []
    for batch in batches:
        losses.append(pipeline_train(pipe, [batch])[0])
        graphs.append(counters["stats"]["unique_graphs"])
    return pipe, reference, torch.stack(losses), torch.stack(want), graphs


def test_compiled_stages_train_as_eager_within_tolerance(trained):
    pipe, reference, got, want, _ = trained
    assert all(isinstance(w.call, CompiledStage) for w in pipe._workers)
    torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)
    for name, tensor in pipe.state_dict().items():  # the model's names: the compiled copy shares the weights
        torch.testing.assert_close(tensor, reference.state_dict()[name], rtol=RTOL, atol=ATOL)


def test_compiled_stages_compile_once_per_shape(trained):
    """The first step compiles each stage (forward and backward); the steps after it at the same shape
    reuse what it compiled."""
    *_, graphs = trained
    assert graphs[1] > graphs[0]
    assert graphs[1] == graphs[2] == graphs[3]


def test_dropout_runs_eagerly_between_the_compiled_pieces():
    """Two dropouts in one stage: dynamo cannot trace a keyed draw's seed (torch 2.13 recursed in its
    struct.pack polyfill), so keyed random ops run eagerly between the compiled pieces, drawing the masks
    of the pipeline without compile: the same training within tolerance."""
    x, y = torch.randn(8, 8), torch.randint(0, 4, (8,))
    losses = []
    for compiled in (True, False):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.2), torch.nn.Tanh(),
                                    torch.nn.Linear(16, 16), torch.nn.Dropout(0.2), torch.nn.Linear(16, 4))
        pipe = sw.compile(model, 2, (x,), loss_fn=F.cross_entropy, example_target=y, microbatches=2,
                          schedule="1f1b", split_points=["5"], cost="analytic", compile_stages=compiled)
        losses.append(torch.stack([pipe.step(x, target=y) for _ in range(2)]))
    torch.testing.assert_close(losses[0], losses[1], rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("draw", ["dropout", "bernoulli"])
def test_compiled_stages_draw_the_masks_of_the_pipeline_without(draw):
    """Keyed random ops run eagerly between the compiled pieces (dynamo cannot trace their seeded
    generators): under varuna, which recomputes every forward of stage 0, a compiled MaskProbe's loss
    (the masks its forwards drew, in its bits) and update (the masks its backward saw) are exactly
    the pipeline's without compile."""
    which = torch.arange(4)  # one sample per microbatch, sample j reads row j of w
    results = []
    for compiled in (True, False):
        torch.manual_seed(0)
        pipe = sw.compile(MaskProbe(microbatches=4, width=5, draw=draw), 2, (which,), microbatches=4,
                          schedule="varuna", cost="analytic", split_points=["1"],
                          optimizer=functools.partial(torch.optim.SGD, lr=1.0), compile_stages=compiled)
        results.append((pipe.step(which), pipe.state_dict()["0.w"]))
    (loss, w), (plain_loss, plain_w) = results
    assert torch.equal(loss, plain_loss) and torch.equal(w, plain_w)


def test_profiled_layers_are_timed_compiled(tmp_path, monkeypatch):
    """cost="profile" with compile_stages: the in-context pass runs each layer through torch.compile, so
    the plan's times are carried to the compiled layers'; the profile is cached apart from the eager one.
    torch.compile is counted here, not run (the pipeline above runs it): each compile costs seconds."""
    monkeypatch.setenv("STAGEWISE_CACHE", str(tmp_path))
    compiled: list[torch.nn.Module] = []
    monkeypatch.setattr(torch, "compile", lambda module: compiled.append(module) or module)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    traced = trace(model, (torch.randn(8, 8),), torch.randint(0, 4, (8,)), F.cross_entropy)
    gm, layers = traced.graph_module, build_layers(traced.graph_module, model)
    profile_layers(gm, layers, "cpu", [8], quiet=True, repeats=1)
    assert compiled == []
    profile_layers(gm, layers, "cpu", [8], quiet=True, repeats=1, compiled=True)
    assert len(compiled) == len(layers) == 2
    assert len(list(tmp_path.rglob("*.json"))) == 2


def test_compile_profiles_compiled_layers_for_compiled_stages(tmp_path, monkeypatch):
    """sw.compile(cost="profile", compile_stages=True) hands the option to the profiler: every layer, then
    every stage, goes through torch.compile (counted, not run)."""
    monkeypatch.setenv("STAGEWISE_CACHE", str(tmp_path))
    compiled: list[torch.nn.Module] = []
    monkeypatch.setattr(torch, "compile", lambda module: compiled.append(module) or module)
    x, y = torch.randn(8, 8), torch.randint(0, 4, (8,))
    pipe = sw.compile(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)), 2, (x,),
                      loss_fn=F.cross_entropy, example_target=y, microbatches=2, cost="profile", compile_stages=True)
    assert len(compiled) == len(pipe.plan.layers) + len(pipe.plan.stages)
    pipe.step(x, target=y)


def test_a_loaded_pipeline_compiles_its_stages_again_and_cuda_graphs_on_a_cpu_are_dropped_said(tmp_path, monkeypatch):
    """The checkpoint keeps compile_stages: a loaded pipeline ran its stages eagerly before, however it was
    compiled. Graphs saved for CUDA devices and loaded onto CPU ones run eagerly, with a warning."""
    compiled: list[torch.nn.Module] = []
    monkeypatch.setattr(torch, "compile", lambda module: compiled.append(module) or module)
    x, y = torch.randn(8, 8), torch.randint(0, 4, (8,))
    pipe = sw.compile(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)), 2, (x,),
                      loss_fn=F.cross_entropy, example_target=y, microbatches=2, cost="analytic", compile_stages=True)
    pipe.save(tmp_path / "compiled")
    compiled.clear()
    loaded = quiet_load(tmp_path / "compiled")
    assert len(compiled) == len(loaded.plan.stages) and loaded._runtime.acceleration.compile_stages
    torch.testing.assert_close(loaded.step(x, target=y), pipe.step(x, target=y), rtol=0, atol=0)
    training = torch.load(tmp_path / "compiled" / "training.pt", weights_only=True)
    buffer = io.BytesIO()
    torch.save({**training, "acceleration": {"compile_stages": False, "cuda_graphs": True, "bucketed": False}}, buffer)
    (tmp_path / "compiled" / "training.pt").write_bytes(buffer.getvalue())
    reseal(tmp_path / "compiled")
    with pytest.warns(UserWarning, match="ran with .*cuda_graphs=True.*run eagerly here.*'cpu' is not a CUDA"):
        eager = sw.load(tmp_path / "compiled")
    assert eager._runtime.acceleration == Acceleration()
    eager.step(x, target=y)
