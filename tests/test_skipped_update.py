"""A step whose gradients hold an inf or NaN is skipped wherever the global norm is computed (fp16,
or clip_grad_norm in any precision): it warns once per pipeline and `pipe.skipped_steps` counts it."""

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F

import stagewise as sw
from tests.models.mlp import mlp
from tests.reference import SGD

BATCH = torch.randn(8, 8), torch.randint(0, 5, (8,))


def _weights(pipe: sw.Pipeline) -> dict[str, torch.Tensor]:
    return {name: tensor.clone() for name, tensor in pipe.state_dict().items()}


@pytest.mark.parametrize(("precision", "clip"), [("fp32", 1.0), ("bf16", 1.0), ("fp16", None)])
def test_a_skipped_update_warns_once_and_is_counted(precision, clip):
    (x, y), poisoned = BATCH, torch.full_like(BATCH[0], float("nan"))
    pipe = sw.compile(mlp(depth=4), 2, (x,), loss_fn=F.cross_entropy, example_target=y, optimizer=SGD,
                      microbatches=2, cost="analytic", precision=precision, clip_grad_norm=clip)
    pipe.step(x, target=y)
    before = _weights(pipe)
    with pytest.warns(sw.SkippedUpdateWarning, match="step 2: the gradients hold an inf or NaN") as caught:
        for _ in range(2):
            pipe.step(poisoned, target=y)
    assert len([w for w in caught if w.category is sw.SkippedUpdateWarning]) == 1  # once per pipeline
    assert pipe.skipped_steps == 2 and pipe.last_step_skipped
    for name, tensor in pipe.state_dict().items():
        assert torch.equal(tensor, before[name]), name
    with warnings.catch_warnings():
        warnings.simplefilter("error", sw.SkippedUpdateWarning)
        pipe.step(x, target=y)
    assert pipe.skipped_steps == 2 and not pipe.last_step_skipped


def test_without_the_norm_a_nan_gradient_updates_as_eager_does():
    """fp32 without clipping computes no norm: the NaN reaches the weights, as in eager training."""
    (x, y), poisoned = BATCH, torch.full_like(BATCH[0], float("nan"))
    model = mlp(depth=4)
    reference = copy.deepcopy(model)
    pipe = sw.compile(model, 2, (x,), loss_fn=F.cross_entropy, example_target=y, optimizer=SGD, microbatches=2,
                      cost="analytic")
    pipe.step(poisoned, target=y)
    opt = SGD(reference.parameters())
    F.cross_entropy(reference(poisoned), y).backward()
    opt.step()
    assert pipe.skipped_steps == 0
    assert all(torch.isnan(tensor).all() for tensor in pipe.state_dict().values())
    assert all(torch.isnan(tensor).all() for tensor in reference.state_dict().values())
