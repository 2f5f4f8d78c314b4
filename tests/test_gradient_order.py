"""One gradient order: every schedule runs each stage's forwards and backwards in microbatch order, so
autograd sums each gradient as ((g0 + g1) + g2) + g3 whatever the schedule or the partition, and BatchNorm
updates its running statistics in the same order. One replica's training is then bitwise the same under
every plan: float addition is not associative, so a schedule that ran its backwards last microbatch first
(gpipe and harmony did) trained other bits, chaotically so under BatchNorm.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import stagewise as sw
from stagewise.ir.instructions import Backward, Forward
from tests.models.cnn import ResNet
from tests.models.dropout import DropoutGPT
from tests.models.gpt import lm_loss
from tests.reference import pipeline_train

STEPS = 3
SGD = functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9)
# (devices, schedule, options): every schedule, gpipe / 1f1b / varuna on two partitions each, one
# replica (harmony-dp on two devices would be two replicas, whose all-reduce is another order)
PLANS = [
    (2, "gpipe", {}), (3, "gpipe", {"split_points": ["blocks.0", "blocks.2"]}), (2, "1f1b", {}), (4, "1f1b", {}),
    (2, "interleaved", {}), (2, "varuna", {}), (3, "varuna", {}), (2, "harmony-pp", {}), (1, "harmony-dp", {}),
]
PLAN_IDS = [f"{d}-{s}{'-split' if o else ''}" for d, s, o in PLANS]


class DropoutResNet(ResNet):
    """The small ResNet (BatchNorm in every block) with dropout before its head."""

    def __init__(self):
        super().__init__(channels=4, blocks=4)
        self.drop = nn.Dropout(0.2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.blocks(torch.relu(self.stem_bn(self.stem(x))))
        return self.head(self.drop(torch.flatten(self.pool(x), 1)))


def _image_batches():
    torch.manual_seed(0)
    return [((torch.randn(8, 3, 8, 8),), torch.randint(0, 10, (8,))) for _ in range(STEPS)]


def _token_batches():
    torch.manual_seed(0)
    ids = [torch.randint(0, 64, (8, 9)) for _ in range(STEPS)]
    return [((i[:, :-1],), i[:, 1:]) for i in ids]


MODELS = {  # name -> (model factory, loss, batches)
    "resnet": (DropoutResNet, F.cross_entropy, _image_batches),
    "gpt": (functools.partial(DropoutGPT, tie=False), lm_loss, _token_batches),
}


def _train(model: str, devices: int, schedule: str, **options):
    """Losses and state after a few steps, from the same initial weights and seed (analytic costs: one plan)."""
    factory, loss_fn, make_batches = MODELS[model]
    batches = make_batches()
    torch.manual_seed(1)
    pipe = sw.compile(factory(), devices, batches[0][0], loss_fn=loss_fn, example_target=batches[0][1],
                      microbatches=4, schedule=schedule, cost="analytic", optimizer=SGD, **options)
    return pipe, torch.stack(pipeline_train(pipe, batches)), pipe.state_dict()


@pytest.fixture(scope="module", params=sorted(MODELS))
def reference(request):
    """The model's training on one device under gpipe: one stage, every sum in microbatch order."""
    _, losses, state = _train(request.param, 1, "gpipe")
    return request.param, losses, state


@pytest.mark.parametrize("devices,schedule,options", PLANS, ids=PLAN_IDS)
def test_training_is_bitwise_the_same_under_every_schedule_and_partition(reference, devices, schedule, options):
    """Losses, parameters and BatchNorm's running statistics all bitwise those of one device."""
    model, want_losses, want_state = reference
    pipe, losses, state = _train(model, devices, schedule, **options)
    assert len(pipe.plan.stages) > 1
    assert torch.equal(losses, want_losses), (losses, want_losses)
    differ = [name for name in want_state if not torch.equal(state[name], want_state[name])]
    assert not differ, f"{schedule} on {devices} devices trained other bits in {differ}"
    for program in pipe.programs:  # what makes it so: each stage's passes in microbatch order
        for kind in (Forward, Backward):
            for stage in {ins.stage for ins in program.instructions}:
                order = [ins.microbatch for ins in program.instructions if type(ins) is kind and ins.stage == stage]
                assert order == sorted(order), (schedule, kind.__name__, stage, order)
