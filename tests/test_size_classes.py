"""A batch of a new shape is sized from its size class (one symbolic propagation), not by running
the stage modules again; the shapes it gives are those a concrete propagation gives, and sizes
outside the class (a guard broken) still go the concrete way, refused where the code cannot take them.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import stagewise as sw
from stagewise.compiler.assembly.step_shapes import StepShapes
from tests.harness.any_shape import eager_split_train, train_steps
from tests.hf import gpt2, llama
from tests.models.gpt import TinyGPT, lm_loss
from tests.reference import ATOL, RTOL, SGD, assert_state_equal


def _lm_batch(batch: int, length: int, generator: torch.Generator) -> tuple[dict, None]:
    ids = torch.randint(1, 128, (batch, length), generator=generator)
    return {"input_ids": ids, "labels": ids.clone()}, None


def test_new_lengths_are_sized_without_running_the_stages_again(monkeypatch):
    """Three new lengths: one propagation (the size class's), and the training is eager's."""
    propagations = []
    propagate = StepShapes._propagate
    monkeypatch.setattr(StepShapes, "_propagate", lambda self, *args: propagations.append(1) or propagate(self, *args))
    torch.manual_seed(0)
    model = llama(2)
    reference = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(0)
    batches = [_lm_batch(8, length, generator) for length in (12, 7, 10, 5)]
    pipe = sw.compile(model, 2, batches[0][0], microbatches=2, optimizer=SGD, cost="analytic")
    got = train_steps(pipe, batches)
    assert len(propagations) == 1
    want = eager_split_train(reference, batches, microbatches=1, optimizer=SGD)
    torch.testing.assert_close(torch.stack(got), torch.stack(want), rtol=RTOL, atol=ATOL)
    assert_state_equal(pipe.state_dict(), reference.state_dict())


@pytest.fixture(scope="module")
def gpt2_shapes() -> StepShapes:
    torch.manual_seed(0)
    ids = torch.randint(1, 128, (8, 12))
    pipe = sw.compile(gpt2(2), 2, {"input_ids": ids, "labels": ids}, microbatches=2, cost="analytic")
    return pipe._feeding.step_shapes


@pytest.fixture(scope="module")
def tiny_gpt_shapes() -> StepShapes:
    torch.manual_seed(0)
    ids = torch.randint(0, 64, (8, 13))
    pipe = sw.compile(TinyGPT(), 2, (ids[:, :-1],), loss_fn=lm_loss, example_target=ids[:, 1:], microbatches=2,
                      cost="analytic")
    return pipe._feeding.step_shapes


def _concrete(shapes: StepShapes, signature) -> dict:
    """The values' shapes as the stage modules give them on fake tensors of these sizes."""
    mode = torch._subclasses.fake_tensor.FakeTensorMode()
    with mode:
        env = {name: torch.empty(size, dtype=dtype) for name, size, dtype in signature}
    return {name: (tuple(v.shape), v.dtype) for name, v in shapes._propagate(mode, env, signature).items()
            if isinstance(v, torch.Tensor)}


def _signature(shapes: StepShapes, batch: int, length: int):
    return tuple((name, (batch, length), dtype) for name, _, dtype in shapes.example)


@pytest.mark.parametrize("shapes_of", ["gpt2_shapes", "tiny_gpt_shapes"])
@pytest.mark.parametrize(("batch", "length"), [(4, 12), (4, 5), (3, 2), (2, 9)])
def test_the_size_class_gives_the_shapes_of_a_concrete_propagation(request, shapes_of, batch, length):
    """The export path (gpt2: sizes read from the inputs) and the fx path (TinyGPT: sizes computed)."""
    shapes = request.getfixturevalue(shapes_of)
    signature = _signature(shapes, batch, length)
    size_class = shapes.size_class(signature)
    assert size_class is not None
    assert size_class.at(signature) == _concrete(shapes, signature)


@pytest.mark.parametrize(("batch", "length", "reason"), [(1, 12, "a sample"), (4, 1, "a token")])
def test_sizes_of_one_fall_outside_the_class_and_are_propagated_concretely(gpt2_shapes, batch, length, reason):
    """The class assumes sizes of at least 2 (torch's 0/1 specialization): a microbatch of one sample
    (an uneven last batch) or of one token is sized concretely."""
    signature = _signature(gpt2_shapes, batch, length)
    assert gpt2_shapes.size_class(gpt2_shapes.example).at(signature) is None, reason
    assert gpt2_shapes._values(signature) == _concrete(gpt2_shapes, signature)


def test_inputs_whose_lengths_disagree_break_the_class(gpt2_shapes):
    """The example's equal lengths are assumed (duck sizing) and guarded: unequal ones go concrete."""
    signature = tuple((name, (4, 10 if index == 0 else 9), dtype)
                      for index, (name, _, dtype) in enumerate(gpt2_shapes.example))
    assert gpt2_shapes.size_class(gpt2_shapes.example).at(signature) is None
    with pytest.raises(sw.ExampleInputsError, match="cannot take"):
        gpt2_shapes._values(signature)


def test_strided_convolutions_are_sized_by_their_floor_divisions():
    """Image sizes through two strided convolutions: the class's sizes are floor divisions of the
    input's, equal to a concrete propagation at every size inside the class."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3, stride=2, padding=1), torch.nn.ReLU(),
                                torch.nn.Conv2d(4, 4, 3, stride=2), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(),
                                torch.nn.Linear(4, 10))
    x, y = torch.randn(8, 3, 17, 23), torch.randint(0, 10, (8,))
    pipe = sw.compile(model, 2, (x,), loss_fn=F.cross_entropy, example_target=y, microbatches=2, cost="analytic",
                      split_points=["2"])
    shapes = pipe._feeding.step_shapes
    (image, _, image_dtype), (target, _, target_dtype) = shapes.example
    for batch, height, width in ((4, 12, 9), (3, 9, 14), (2, 31, 5)):
        signature = ((image, (batch, 3, height, width), image_dtype), (target, (batch,), target_dtype))
        assert shapes.size_class(signature).at(signature) == _concrete(shapes, signature)
