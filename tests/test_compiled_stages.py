"""compile_stages=True: each stage module through torch.compile (inductor, on 2 CPU devices), trained
against the same pipeline without it. Not bitwise (inductor fuses and reorders float ops): within
the tolerance the eager-equality tests use (tests/reference.py RTOL, ATOL), in fp32. One compiled
pipeline serves the file: inductor's compile is the cost (seconds per stage)."""

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

import stagewise as sw
from stagewise.passes.capture import trace
from stagewise.passes.layers import build_layers
from stagewise.passes.profile import profile_layers
from stagewise.runtime.stage_calls import CompiledStage
from tests.reference import ATOL, RTOL, SGD, pipeline_train


def _model() -> torch.nn.Module:
    """Dropout between the layers: its keyed masks run eagerly between the compiled pieces."""
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Dropout(0.2), torch.nn.Linear(16, 16),
                               torch.nn.Tanh(), torch.nn.Linear(16, 4))


def _pipe(compiled: bool, batch: tuple) -> sw.Pipeline:
    torch.manual_seed(0)
    return sw.compile(_model(), 2, batch[0], loss_fn=F.cross_entropy, example_target=batch[1], optimizer=SGD,
                      microbatches=2, schedule="1f1b", cost="analytic", seed=0, compile_stages=compiled)


@pytest.fixture(scope="module")
def trained():
    """Both pipelines after 3 steps of one shape, and the compiles counted after each step."""
    generator = torch.Generator().manual_seed(1)
    batches = [((torch.randn(8, 8, generator=generator),), torch.randint(0, 4, (8,), generator=generator))
               for _ in range(3)]
    compiled, plain = _pipe(True, batches[0]), _pipe(False, batches[0])
    graphs = [counters["stats"]["unique_graphs"]]
    losses = []
    for batch in batches:
        losses.append(pipeline_train(compiled, [batch])[0])
        graphs.append(counters["stats"]["unique_graphs"])
    return compiled, plain, torch.stack(losses), torch.stack(pipeline_train(plain, batches)), graphs


def test_compiled_stages_train_as_the_pipeline_without_within_tolerance(trained):
    compiled, plain, got, want, _ = trained
    assert all(isinstance(w.call, CompiledStage) for w in compiled._workers)
    torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)
    state = plain.state_dict()
    for name, tensor in compiled.state_dict().items():  # the model's names: the compiled copy shares the weights
        torch.testing.assert_close(tensor, state[name], rtol=RTOL, atol=ATOL)


def test_compiled_stages_compile_once_per_shape(trained):
    """The first step compiles each stage's pieces (forward and backward, split at the dropout); the
    steps after it at the same shape reuse them."""
    *_, graphs = trained
    assert graphs[1] > graphs[0]
    assert graphs[1] == graphs[2] == graphs[3]


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
