"""Every yes/no option of the public API takes True or False only: a truthy "no" must not switch it
on. Each is refused with an OptionError naming the option and the value, before anything happens."""

import pytest
import torch
import torch.nn.functional as F

import stagewise as sw
from tests.models.mlp import mlp

X, Y = torch.randn(4, 8), torch.randint(0, 5, (4,))


@pytest.fixture(scope="module")
def pipe():
    return sw.compile(mlp(depth=3), 2, (X,), loss_fn=F.cross_entropy, example_target=Y, microbatches=2,
                      cost="analytic")


NOT_BOOLS = ["no", 0, None]


@pytest.mark.parametrize("value", NOT_BOOLS)
@pytest.mark.parametrize("option", ["training_state", "report"])
def test_restore(pipe, tmp_path, option, value):
    """Refused before the checkpoint is looked for (there is none: a later check would name that)."""
    with pytest.raises(sw.OptionError, match=f"{option}={value!r} must be True or False"):
        pipe.restore(tmp_path / "absent", **{option: value})


@pytest.mark.parametrize("value", NOT_BOOLS[:2])
@pytest.mark.parametrize("option", ["replan", "report"])
def test_load(tmp_path, option, value):
    with pytest.raises(sw.OptionError, match=f"{option}={value!r} must be True or False"):
        sw.load(tmp_path / "absent", **{option: value})


@pytest.mark.parametrize("value", NOT_BOOLS)
def test_save_asynchronous(pipe, tmp_path, value):
    with pytest.raises(sw.OptionError, match=f"asynchronous={value!r} must be True or False"):
        pipe.save(tmp_path / "ckpt", asynchronous=value)
    assert not (tmp_path / "ckpt").exists()


@pytest.mark.parametrize("value", NOT_BOOLS)
def test_periodic_checkpoints_asynchronous(tmp_path, value):
    with pytest.raises(sw.OptionError, match=f"asynchronous={value!r} must be True or False"):
        sw.Checkpoints(tmp_path, every_steps=1, asynchronous=value)


@pytest.mark.parametrize("value", NOT_BOOLS)
def test_train_mode(pipe, value):
    with pytest.raises(sw.OptionError, match=f"mode={value!r} must be True or False"):
        pipe.train(value)
    assert pipe.training


@pytest.mark.parametrize("value", NOT_BOOLS)
def test_load_state_dict_strict(pipe, value):
    with pytest.raises(sw.OptionError, match=f"strict={value!r} must be True or False"):
        pipe.load_state_dict({}, strict=value)


@pytest.mark.parametrize("value", NOT_BOOLS)
def test_compile_optimizer_on_host(value):
    with pytest.raises(sw.OptionError, match=f"optimizer_on_host={value!r} must be True or False"):
        sw.compile(mlp(depth=3), 2, (X,), loss_fn=F.cross_entropy, example_target=Y, microbatches=2,
                   cost="analytic", optimizer_on_host=value)
