"""One capture of a model serves every microbatch size (passes/capture.Capture).

torch.export is asked once for a graph with a symbolic batch; the graph at a size is that graph
with the symbol bound: node values and FLOPs as fake-tensor propagation gives them, literal sizes
in the code as an export at that size writes them. Models that pin their batch are exported again
per size, and size 1 (which export assumes away) is used only when it agrees with eager.
"""

import copy

import pytest
import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_flatten

import stagewise as sw
from stagewise.passes.capture import annotate, capture, trace
from tests.hf import gpt2, lm_batches
from tests.models.gpt import TinyGPT, lm_loss
from tests.reference import SGD, assert_state_equal, check_equal_training, eager_train, pipeline_train


@pytest.fixture
def exports(monkeypatch):
    """torch.export.export calls, True for those asked for a symbolic batch."""
    calls = []
    original = torch.export.export

    def counting(*args, **kwargs):
        calls.append(kwargs.get("dynamic_shapes") is not None)
        return original(*args, **kwargs)

    monkeypatch.setattr(torch.export, "export", counting)
    return calls


def test_planner_exports_once_and_trains_equal_to_eager(exports):
    model, batches = gpt2(), lm_batches(batch=16)
    reference = copy.deepcopy(model)
    pipe = sw.compile(model, 2, batches[0][0], optimizer=SGD, cost="analytic")  # microbatches=None
    assert pipe.plan.tracer == "export"
    assert len({line.split()[1] for line in pipe.plan.considered}) > 1  # several microbatch counts weighed
    assert exports == [True]
    got = pipeline_train(pipe, batches)
    want = eager_train(reference, batches, optimizer=SGD, microbatches=pipe.plan.microbatches)
    torch.testing.assert_close(torch.stack(got), torch.stack(want), rtol=1e-5, atol=1e-6)
    assert_state_equal(pipe.state_dict(), reference.state_dict())


def _values(gm):
    """Per node: shapes and dtypes of its value, and its FLOPs."""
    out = {}
    for node in gm.graph.nodes:
        flat = tree_flatten(node.meta.get("val"))[0]
        out[node.name] = ([(tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else v for v in flat],
                          node.meta.get("flops"))
    return out


def _gpt_batch(b: int):
    ids = torch.randint(0, 64, (b, 17), generator=torch.Generator().manual_seed(b))
    return (ids[:, :-1],), ids[:, 1:]


def test_graph_at_each_size_is_the_export_at_that_size(exports):
    torch.manual_seed(0)
    model = TinyGPT(vocab=64, dim=32, heads=4, layers=2, context=16)
    once = capture(model, *_gpt_batch(4), lm_loss, dynamic=True)
    assert exports == [True] and once.exported.symbolic
    for b in (4, 2, 3, 1):
        inputs, target = _gpt_batch(b)
        gm = once.at(inputs, target).graph_module
        assert once.exports == 1
        # the code reads its sizes from its inputs (passes/local_sizes.py), and computes what an export
        # at this size does, bit for bit
        assert "sym_size" in gm.code
        static = trace(model, inputs, target, lm_loss).graph_module
        torch.testing.assert_close(gm(*inputs, target), static(*inputs, target), rtol=0, atol=0)
        # values and FLOPs evaluated from the symbolic export = fake-tensor propagation at this size
        propagated = torch.fx.GraphModule(gm, copy.deepcopy(gm.graph))
        annotate(propagated, inputs, target)
        assert _values(gm) == _values(propagated)
        torch.testing.assert_close(gm(*inputs, target), lm_loss(model(*inputs), target), rtol=0, atol=0)


class PinnedBatch(nn.Module):
    """Python reads the batch size (fx cannot trace it); export pins the batch to the example's."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        scale = 2.0 if x.shape[0] == 4 else 1.0
        return self.lin(x).pow(2).mean() * scale


class SpecialBatchOfOne(nn.Module):
    """A batch of one takes another path: an export with a symbolic batch (assumed >= 2) misses it."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        if x.shape[0] == 1:
            return self.lin(x).sum() * 3.0
        return self.lin(x).pow(2).mean()


@pytest.mark.parametrize(("model_class", "sizes", "expected_exports"),
                         [(PinnedBatch, (4, 2, 4), 2), (SpecialBatchOfOne, (4, 2, 1), 2)])
def test_sizes_the_symbolic_export_does_not_cover_are_exported_again(exports, model_class, sizes, expected_exports):
    torch.manual_seed(0)
    model = model_class()
    x = torch.randn(4, 4)
    once = capture(model, (x,), None, None, dynamic=True)
    assert once.tracer == "export"
    assert once.exported.symbolic == (model_class is SpecialBatchOfOne)  # PinnedBatch: export specialised it
    for b in sizes:
        gm = once.at((x[:b],), None).graph_module
        torch.testing.assert_close(gm(x[:b]), model(x[:b]), rtol=0, atol=0)
    assert once.exports == expected_exports == len(exports)


class EvenBatch(nn.Module):
    """The same function at every batch, one included (a branch on the batch: fx cannot trace it, export can)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        if x.shape[0] > 0:
            return self.lin(x).pow(2).mean()
        return x.sum()


@pytest.mark.parametrize(("model_class", "smallest"), [(EvenBatch, 1), (SpecialBatchOfOne, 2)])
def test_smallest_microbatch_runs_the_graph_at_one_sample_without_evaluating_it(monkeypatch, exports, model_class,
                                                                                smallest):
    """One sample is allowed only where the symbolic graph, run on it, gives eager's loss; the check
    runs the graph and plans nothing at that size: no export, no FLOPs counted."""
    torch.manual_seed(0)
    once = capture(model_class(), (torch.randn(4, 4),), None, None, dynamic=True)
    counted = []
    monkeypatch.setattr("stagewise.passes.capture.op_flops", lambda *args: counted.append(args) or 0)
    assert once.smallest_microbatch((torch.randn(4, 4),), None, planned=4) == smallest
    assert (len(exports), once.exports, len(counted)) == (1, 1, 0)


def test_export_makes_its_fake_tensors_without_the_dispatch_cache(monkeypatch):
    """Under symbolic sizes a cache hit costs more than the op it saves in one export
    (bench/export_cache.py): export's fake-tensor modes are made without it, torch's setting is back after."""
    made = []
    original = FakeTensorMode.__init__

    def recording(self, *args, **kwargs):
        original(self, *args, **kwargs)
        made.append(self.cache_enabled)

    monkeypatch.setattr(FakeTensorMode, "__init__", recording)
    assert capture(EvenBatch(), (torch.randn(4, 4),), None, None, dynamic=True).tracer == "export"
    assert made and not any(made)
    assert torch._dynamo.config.fake_tensor_cache_enabled


def test_fx_graphs_are_traced_once_and_propagated_per_size(exports):
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    once = capture(model, (torch.randn(4, 4),), torch.randn(4, 1), nn.functional.mse_loss, dynamic=True)
    assert once.tracer == "fx" and exports == []
    for b in (4, 2, 1):
        gm = once.at((torch.randn(b, 4),), torch.randn(b, 1)).graph_module
        (x, *_) = [n for n in gm.graph.nodes if n.op == "placeholder"]
        assert tuple(x.meta["val"].shape) == (b, 4)
        assert gm.graph is not once.template.graph


class _Mixed(nn.Module):
    """Leaf modules alike but for a flag (batch_first) or a shape, and modules with children."""

    def __init__(self):
        super().__init__()
        self.enc = nn.ModuleList([nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True),
                                  nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0)])
        self.rnn = nn.ModuleList([nn.LSTM(16, 8, batch_first=True), nn.LSTM(16, 8)])
        self.chain = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.ReLU()) for _ in range(6)], nn.Linear(8, 4))

    def forward(self, x):
        x = self.enc[1](self.enc[0](x))
        a, _ = self.rnn[0](x)
        b, _ = self.rnn[1](x)
        return self.chain(a).sum() + self.chain(b).mean()


def test_fake_propagation_runs_repeated_leaf_modules_once_with_the_same_values():
    from torch._subclasses.fake_tensor import FakeTensorMode

    from stagewise.passes.capture_annotate import _CountingProp

    class EveryModule(_CountingProp):
        def _module_key(self, n):
            return None

    x = torch.randn(4, 6, 16)
    once = capture(_Mixed(), (x,), None, None)
    assert once.tracer == "fx"
    found = []
    for prop in (_CountingProp, EveryModule):
        gm = torch.fx.GraphModule(once.template, copy.deepcopy(once.template.graph))
        propagation = prop(gm, FakeTensorMode(allow_non_fake_inputs=True))
        propagation.propagate(x)
        strides = {n.name: n.meta["val"].stride() for n in gm.graph.nodes if isinstance(n.meta.get("val"), torch.Tensor)}
        found.append((_values(gm), strides))
        if prop is _CountingProp:
            assert len(propagation.memo) < sum(n.op == "call_module" for n in gm.graph.nodes)
    assert found[0] == found[1]


@pytest.mark.parametrize("name", ["hf-gpt2", "hf-llama", "tied-gpt"])
def test_stage_code_makes_its_tensors_on_the_device_it_runs_on(name):
    """Traced on the CPU, torch.export writes device=cpu into `arange` (position ids) and `to` (rotary
    frequencies); the stage code reads the device from its inputs instead, so a stage placed on a GPU
    makes those tensors there. Checked with fake CUDA tensors: every stage, in pipeline order."""
    from stagewise.compiler.assembly.step_shapes import StepShapes
    from tests.hf import llama

    torch.manual_seed(0)
    if name == "tied-gpt":
        ids = torch.randint(0, 64, (4, 12))  # shorter than its context: the length stays symbolic
        pipe = sw.compile(TinyGPT(), 2, (ids,), loss_fn=lm_loss, example_target=ids, microbatches=2, cost="analytic")
    else:
        ids = torch.randint(0, 100, (4, 16))
        pipe = sw.compile((gpt2 if name == "hf-gpt2" else llama)(2), 2, {"input_ids": ids, "labels": ids},
                          microbatches=2, cost="analytic")
    assert not any("device(type=" in stage.code for stage in pipe.stages)
    cpu = pipe._feeding.step_shapes
    gpu = StepShapes(pipe.plan, cpu.modules, cpu.states, [torch.device("cuda", 0)] * len(pipe.plan.devices))
    shorter = {name: torch.zeros(2, 9, dtype=torch.int64) for name in pipe.plan.graph_inputs}
    assert gpu.of_step([shorter]) is not None  # no device mismatch on the way


class NoGradBlock(nn.Module):
    """A `torch.no_grad()` block reads a weight (no gradient flows through it in eager) and updates a
    running buffer. fx would trace it without the block (the weight then trained through it): the
    capture refuses fx there, and torch.export makes the block a `wrap_with_set_grad_enabled` region
    (as transformers 5.17's Llama rotary embedding)."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
        self.register_buffer("seen", torch.zeros(8))

    def forward(self, x):
        with torch.no_grad():
            scale = self.blocks[0].weight.norm()
            self.seen.add_(x.mean(0))
        for block in self.blocks:
            x = torch.tanh(block(x))
        return x * scale


def test_a_no_grad_block_trains_as_eager_runs_it_and_saves(tmp_path):
    """The region is inlined with its inputs detached (passes/capture_grad_regions.py): the stage code
    is plain ATen, so it saves as a stage structure and loads (a nested graph module did not: PlanError);
    the weight gets no gradient through the block, the buffer is updated in place."""
    torch.manual_seed(0)
    batches = [((torch.randn(8, 8),), torch.randn(8, 8)) for _ in range(3)]
    pipe = check_equal_training(NoGradBlock(), batches[:2], 2, loss_fn=nn.functional.mse_loss, microbatches=2,
                                cost="analytic")
    assert pipe.plan.tracer == "export"
    assert not any("higher_order" in stage.code for stage in pipe.stages)
    pipe.save(tmp_path / "ck")
    loaded = sw.load(tmp_path / "ck", report=False)
    (x,), y = batches[2]
    torch.testing.assert_close(loaded.step(x, target=y), pipe.step(x, target=y), rtol=0, atol=0)


def test_a_no_grad_block_compiled_under_no_grad_trains_as_eager_runs_it():
    """Export drops a no_grad block that matches the mode it traces under: the capture exports with
    grad enabled whatever the caller's mode (compiled under no_grad, the weight got a gradient)."""
    torch.manual_seed(0)
    batches = [((torch.randn(8, 8),), torch.randn(8, 8)) for _ in range(2)]
    model = NoGradBlock()
    reference = copy.deepcopy(model)
    with torch.no_grad():
        pipe = sw.compile(model, 2, batches[0][0], loss_fn=nn.functional.mse_loss, example_target=batches[0][1],
                          optimizer=SGD, microbatches=2, cost="analytic")
    got = pipeline_train(pipe, batches)
    want = eager_train(reference, batches, loss_fn=nn.functional.mse_loss, optimizer=SGD, microbatches=2)
    torch.testing.assert_close(torch.stack(got), torch.stack(want), rtol=1e-5, atol=1e-6)
    assert_state_equal(pipe.state_dict(), reference.state_dict())
