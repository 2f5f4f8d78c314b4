"""A step reads its microbatches' sizes once where the batch splits evenly (every step pays this
check): the transfers it sizes are those read microbatch by microbatch, and a batch whose tensors
do not all divide is read piece by piece."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

import stagewise as sw
from stagewise.compiler.assembly.batches import split_batch, splits_evenly


def test_a_batch_splits_evenly_only_where_every_tensors_first_dim_divides():
    assert splits_evenly({"x": torch.zeros(8, 3), "scale": torch.zeros(())}, 4)
    assert not splits_evenly({"x": torch.zeros(8, 3), "table": torch.zeros(10, 3)}, 4)  # 3, 3, 2, 2 rows
    assert not splits_evenly((torch.zeros(6, 3),), 4)


def test_an_even_split_read_once_sizes_the_transfers_as_read_piece_by_piece():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    pipe = sw.compile(model, 2, (x,), loss_fn=F.mse_loss, example_target=y, microbatches=2, cost="analytic")
    shapes = pipe._feeding.step_shapes
    names = dict(zip(pipe.plan.input_names + (pipe.plan.target_name,), pipe.plan.graph_inputs, strict=True))
    for batch in (6, 8):  # unlike the example (3 samples a microbatch), then like it
        inputs = {names[k]: v[:batch] for k, v in zip(names, (x, y), strict=True)}
        pieces = split_batch(inputs, 2)
        assert shapes.of_step(pieces, alike=True) == shapes.of_step(pieces)
    assert shapes.of_step(split_batch({k: v[:6] for k, v in inputs.items()}, 2), alike=True) is not None
    assert pipe.step(x[:6], target=y[:6]).isfinite()  # the step's own path takes the even split
