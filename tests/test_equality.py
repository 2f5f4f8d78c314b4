"""Every pipeline trains exactly like eager single-device training (losses and parameters, 1e-5)."""

import pytest
import torch
import torch.nn.functional as F

from tests.models.cnn import ResNet
from tests.models.encdec import EncoderDecoder
from tests.models.gpt import TinyGPT, lm_loss
from tests.models.mlp import mlp
from tests.reference import ADAMW, SGD, check_equal_training, eager_train, token_batches


def classification_batches(steps=3, batch=8):
    return [((torch.randn(batch, 8),), torch.randint(0, 5, (batch,))) for _ in range(steps)]


@pytest.mark.parametrize("devices", [1, 2, 3, 4])
@pytest.mark.parametrize("microbatches", [1, 2, 4])
def test_mlp(devices, microbatches):
    check_equal_training(mlp(), classification_batches(), devices, loss_fn=F.cross_entropy, microbatches=microbatches)


@pytest.mark.parametrize(
    ("devices", "microbatches", "optimizer", "clip"),
    [(1, 1, SGD, None), (2, 2, ADAMW, 0.5), (3, 4, SGD, 0.1), (4, 4, ADAMW, None), (4, 2, SGD, 0.5)],
)
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_tied_gpt(devices, microbatches, optimizer, clip, schedule):
    pipe = check_equal_training(
        TinyGPT(), token_batches(), devices, loss_fn=lm_loss, optimizer=optimizer,
        microbatches=microbatches, clip_grad_norm=clip, schedule=schedule,
    )
    if devices > 1:
        (tied,) = pipe.shared
        assert set(tied.names) == {"tok.weight", "head.weight"} and tied.kind == "tied-parameter"
        assert tied.stages == (0, devices - 1)
    # the tie holds in every stage that holds a replica
    replicas = [
        p for stage in pipe.stages for n, p in stage.named_parameters(remove_duplicate=False) if n in ("tok.weight", "head.weight")
    ]
    assert all(torch.equal(r, replicas[0]) for r in replicas)


@pytest.mark.parametrize(("devices", "microbatches", "optimizer"), [(2, 2, SGD), (3, 4, ADAMW), (4, 1, SGD)])
def test_resnet_with_batchnorm(devices, microbatches, optimizer):
    """Reference: eager with the same microbatch split and gradient accumulation (BatchNorm sees microbatches)."""
    batches = [((torch.randn(8, 3, 8, 8),), torch.randint(0, 10, (8,))) for _ in range(3)]
    check_equal_training(ResNet(), batches, devices, loss_fn=F.cross_entropy, optimizer=optimizer, microbatches=microbatches)


@pytest.mark.parametrize("devices", [2, 4])
def test_encoder_output_feeds_every_decoder_stage(devices):
    batches = [((torch.randint(0, 40, (4, 6)), torch.randint(0, 40, (4, 5))), torch.randint(0, 40, (4, 5))) for _ in range(3)]
    pipe = check_equal_training(EncoderDecoder(), batches, devices, loss_fn=lm_loss, optimizer=ADAMW, microbatches=2,
                                clip_grad_norm=1.0)
    if devices == 4:
        # the encoder's last output is made in one stage and reaches each later stage that has decoder layers
        encoder_out = [t for t in pipe.plan.transfers if t.value == "encoder_2_add"]
        assert encoder_out and all(t.route == "direct" for t in encoder_out)


def test_microbatched_equals_full_batch_for_batch_independent_models():
    """Gradient accumulation over equal microbatches is the minibatch mean: the reference is honest."""
    import copy

    model, batches = mlp(), classification_batches()
    twin = copy.deepcopy(model)
    full = eager_train(model, batches, loss_fn=F.cross_entropy, microbatches=1)
    split = eager_train(twin, batches, loss_fn=F.cross_entropy, microbatches=4)
    torch.testing.assert_close(torch.stack(full), torch.stack(split), rtol=1e-5, atol=1e-6)
