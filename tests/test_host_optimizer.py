"""The optimizer step on the host (`optimizer_on_host=True`, Harmony's CPU update, ZeRO-Offload):
the devices never hold optimizer state, the gradients and updated weights cross the host link,
and training still equals eager training."""

import copy

import pytest
import torch

import stagewise as sw
from stagewise.ir.instructions import HostUpdate, Stream, Update
from tests.hf import gpt2, lm_batches
from tests.models.gpt import TinyGPT, lm_loss
from tests.reference import (
    ADAMW,
    SGD,
    assert_state_equal,
    check_equal_training,
    eager_train,
    pipeline_train,
    token_batches,
)


def host_updates(pipe) -> list:
    return [i for p in pipe.programs for i in p.instructions if isinstance(i, (Update, HostUpdate))]


def assert_optimizer_on_host(pipe) -> None:
    updates = host_updates(pipe)
    assert updates and all(isinstance(u, HostUpdate) and u.stream is Stream.SWAP_OUT for u in updates)
    for stats in pipe.stats:
        assert stats["optimizer_bytes"] == 0 and stats["swap_optimizer_bytes"] == 0
        assert stats["swap_grads_bytes"] > 0 and stats["swap_in_bytes"] > 0  # gradients out, weights in
    for worker in pipe._workers:
        for state in worker.optimizer.state.values():
            assert all(v.device.type == "cpu" for v in state.values() if isinstance(v, torch.Tensor))
        for name, param in worker.params.items():  # the masters are host tensors of their own
            master = worker.host[("weights", name)]
            assert master.dtype == torch.float32
            assert param.data.numel() == 0 or param.data.untyped_storage().data_ptr() != master.untyped_storage().data_ptr()
    pipe.simulate()


@pytest.mark.parametrize(
    ("schedule", "swap", "optimizer", "clip"),
    [
        ("1f1b", "off", SGD, None),
        ("gpipe", "off", ADAMW, 0.1),
        ("1f1b", "on", ADAMW, None),
        ("gpipe", "on", SGD, 0.1),
        ("harmony-pp", "on", ADAMW, 0.1),
        ("harmony-dp", "on", SGD, None),
        ("harmony-pp", "off", SGD, 0.1),
    ],
)
def test_tied_gpt_with_the_optimizer_on_the_host_trains_like_eager(schedule, swap, optimizer, clip):
    pipe = check_equal_training(TinyGPT(layers=4), token_batches(), 2, loss_fn=lm_loss, optimizer=optimizer,
                                microbatches=4, schedule=schedule, swap=swap, clip_grad_norm=clip,
                                optimizer_on_host=True)
    assert_optimizer_on_host(pipe)
    assert sum(s["swap_weights_bytes"] for s in pipe.stats) > 0


@pytest.mark.parametrize(("swap", "optimizer", "clip"), [("off", ADAMW, 0.5), ("on", SGD, 0.5)])
def test_hf_gpt2_with_the_optimizer_on_the_host(swap, optimizer, clip):
    pipe = check_equal_training(gpt2(layers=4), lm_batches(), 2, optimizer=optimizer, microbatches=2,
                                schedule="harmony-pp" if swap == "on" else "1f1b", swap=swap, clip_grad_norm=clip,
                                optimizer_on_host=True)
    assert_optimizer_on_host(pipe)


def test_weights_and_gradients_fit_where_the_optimizer_state_would_not():
    """AdamW's moments are twice the weights: devices that hold weights, gradients and activations
    but not the moments train without swapping once the optimizer is on the host."""
    model = TinyGPT(layers=4, dim=64)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    capacity = int(1.6 * weights)  # per device: its half of the model, 4x its weights with AdamW on it
    devices = [sw.Device("cpu", memory=capacity) for _ in range(2)]
    pipe = check_equal_training(model, token_batches(batch=4), devices, loss_fn=lm_loss, optimizer=ADAMW,
                                microbatches=2, schedule="1f1b", swap="off", clip_grad_norm=0.5,
                                optimizer_on_host=True)
    assert_optimizer_on_host(pipe)
    assert all(0 < s["peak_bytes"] <= capacity for s in pipe.stats)
    # the simulator sees the refreshed weights overwrite the resident ones: no growth over the step
    memory = pipe.simulate().memory
    assert all(steps[-1][1] == steps[0][1] for steps in memory.values())


@pytest.mark.parametrize("swap", ["off", "on"])
def test_save_load_with_the_optimizer_on_the_host(tmp_path, swap):
    batches = token_batches(steps=2)
    pipe = sw.compile(TinyGPT(), 2, batches[0][0], loss_fn=lm_loss, example_target=batches[0][1], optimizer=ADAMW,
                      microbatches=2, schedule="harmony-pp", swap=swap, clip_grad_norm=0.5, optimizer_on_host=True)
    pipeline_train(pipe, batches)
    pipe.save(tmp_path / "ck")
    loaded = sw.load(tmp_path / "ck")
    assert_state_equal(loaded.state_dict(), pipe.state_dict())
    more = token_batches(steps=2)
    torch.testing.assert_close(torch.stack(pipeline_train(loaded, more)), torch.stack(pipeline_train(pipe, more)),
                               rtol=0, atol=0)
    assert_state_equal(loaded.state_dict(), pipe.state_dict())
    assert_optimizer_on_host(loaded)


@pytest.mark.parametrize("swap", ["off", "on"])
def test_load_state_dict_between_steps_reaches_the_host_masters(swap):
    """Weights loaded into the pipeline after host updates are the ones the next update steps
    (the optimizer keeps its state, as an eager optimizer does across model.load_state_dict)."""
    model, batches = TinyGPT(), token_batches(steps=4)
    reference = copy.deepcopy(model)
    pipe = sw.compile(model, 2, batches[0][0], loss_fn=lm_loss, example_target=batches[0][1], optimizer=SGD,
                      microbatches=2, schedule="1f1b", swap=swap, optimizer_on_host=True)
    opt = SGD(reference.parameters())
    got, want = pipeline_train(pipe, batches[:2]), eager_train(reference, batches[:2], loss_fn=lm_loss,
                                                               microbatches=2, optimizer=lambda _: opt)
    fresh = TinyGPT().state_dict()
    pipe.load_state_dict(fresh)
    reference.load_state_dict(fresh)
    got += pipeline_train(pipe, batches[2:])
    want += eager_train(reference, batches[2:], loss_fn=lm_loss, microbatches=2, optimizer=lambda _: opt)
    torch.testing.assert_close(torch.stack(got), torch.stack(want), rtol=1e-5, atol=1e-6)
    assert_state_equal(pipe.state_dict(), reference.state_dict())
