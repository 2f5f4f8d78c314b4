"""In-place activations (torchvision's ResNet, MobileNetV3, DenseNet) train equal to eager: with
the default profiler, with the analytic costs, and with a stage that begins at the in-place module."""

import itertools

import pytest
import torch
import torch.nn.functional as F

import stagewise as sw
from stagewise.passes.capture import capture
from stagewise.passes.capture_annotate import annotate
from stagewise.passes.capture_functional import functionalize
from tests.models.densenet import DenseNet
from tests.models.mobilenet import MobileNetV3Small
from tests.models.resnet_inplace import ResNetInplace
from tests.reference import check_equal_training

# model, split_points of 2 and 3 stages whose later stages each begin at an in-place op
MODELS = {
    "resnet": (ResNetInplace, ["relu"], ["relu", "layer2.0"]),  # ReLU(inplace=True) on bn1's output
    "mobilenet": (MobileNetV3Small, ["classifier.1"], ["features.1", "classifier.1"]),  # Hardswish(inplace=True)
    "densenet": (DenseNet, ["features.2"], ["features.2", "classifier"]),  # ReLU(inplace=True); torch.relu_
}


def image_batches(steps=2, batch=8, size=8):
    return [((torch.randn(batch, 3, size, size),), torch.randint(0, 10, (batch,))) for _ in range(steps)]


COSTS, DEVICES = ("profile", "analytic"), (2, 3)
# (model, cost, devices): each of the two tests below runs every pair of them (a covering array), and
# the two together every triple: each model, costed either way, trains equal to eager on 2 and on 3
# devices, once cut where the planner chooses and once at its in-place modules.
PLANNED_CUTS = [("resnet", "profile", 2), ("resnet", "analytic", 3), ("mobilenet", "profile", 3),
                ("mobilenet", "analytic", 2), ("densenet", "profile", 2), ("densenet", "analytic", 3)]
INPLACE_CUTS = sorted(set(itertools.product(MODELS, COSTS, DEVICES)) - set(PLANNED_CUTS))


def test_the_cases_cover_every_pair_and_together_every_triple():
    for cases in (PLANNED_CUTS, INPLACE_CUTS):
        for a, b in itertools.combinations(range(3), 2):
            axes = (tuple(MODELS), COSTS, DEVICES)
            missing = set(itertools.product(axes[a], axes[b])) - {(case[a], case[b]) for case in cases}
            assert not missing, missing
    assert set(PLANNED_CUTS) | set(INPLACE_CUTS) == set(itertools.product(MODELS, COSTS, DEVICES))


@pytest.mark.parametrize(("name", "cost", "devices"), PLANNED_CUTS)
def test_trains_equal_to_eager(name, cost, devices):
    model = MODELS[name][0]()
    check_equal_training(model, image_batches(), devices, loss_fn=F.cross_entropy, microbatches=2, cost=cost)


@pytest.mark.parametrize(("name", "cost", "devices"), INPLACE_CUTS)
def test_stage_begins_at_inplace_module(name, cost, devices):
    cls, two, three = MODELS[name]
    splits = two if devices == 2 else three
    pipe = check_equal_training(cls(), image_batches(), devices, loss_fn=F.cross_entropy, microbatches=2,
                                cost=cost, split_points=splits, schedule="1f1b")
    assert [pipe.plan.layers[s.layers[0]].name for s in pipe.plan.stages[1:]] == splits


def test_users_model_keeps_its_inplace_modules():
    model = ResNetInplace()
    x = torch.randn(4, 3, 8, 8)
    sw.compile(model, 2, (x,), loss_fn=F.cross_entropy, example_target=torch.randint(0, 10, (4,)), cost="analytic")
    assert model.relu.inplace and all(block.relu.inplace for block in model.layer1)


class ViewsAndMethods(torch.nn.Module):
    """In-place ops the capture must keep (a view modified in place) beside ones it rewrites."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(6, 6)
        self.act = torch.nn.Hardswish(inplace=True)

    def forward(self, x):
        y = self.act(self.linear(x)) * 1
        y.view(-1)[:6].relu_()  # modifies y through a view: must stay in place
        w = y * 2
        w.add_(y)
        w += 1
        w = torch.relu_(w)
        return (w * y).sum() + F.hardsigmoid(y * 3, inplace=True).sum()


@pytest.mark.parametrize("tracer", ["fx", "export"])
def test_capture_keeps_what_an_alias_sees(tracer, monkeypatch):
    model, x = ViewsAndMethods(), torch.randn(4, 6)
    if tracer == "export":
        monkeypatch.setattr("stagewise.passes.capture._TRACERS", capture.__globals__["_TRACERS"][1:])
    traced = capture(model, (x,), None, None).at((x,), None)
    assert traced.tracer == tracer
    with torch.no_grad():
        torch.testing.assert_close(traced.graph_module(x), model(x))
    check_equal_training(ViewsAndMethods(), [((torch.randn(4, 6),), None) for _ in range(2)], 2, cost="analytic",
                         split_points=["act"])


@pytest.mark.parametrize(("inplace", "recompiles"), [(False, 0), (True, 1)])
def test_functionalize_generates_the_code_again_only_for_a_graph_it_changed(monkeypatch, inplace, recompiles):
    """A compile functionalizes the graph at every size it weighs: a graph with nothing to rewrite keeps
    the code its module already has."""
    model, x = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.ReLU(inplace=inplace)), torch.randn(4, 6)
    gm = torch.fx.symbolic_trace(model)
    annotate(gm, (x,), None)
    generated = []
    original = torch.fx.GraphModule.recompile
    monkeypatch.setattr(torch.fx.GraphModule, "recompile", lambda self: generated.append(self) or original(self))
    functionalize(gm)
    assert len(generated) == recompiles and not gm.get_submodule("1").inplace
    with torch.no_grad():
        torch.testing.assert_close(gm(x), model(x))
