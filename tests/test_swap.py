"""Swapping to host memory: models larger than the devices train exactly like eager training,
every device stays under its capacity, and weight swap volumes match Harmony's Table 3."""

import pytest
import torch

import stagewise as sw
from stagewise.ir.instructions import GradNormPart, HostUpdate, Update
from tests.hf import gpt2, lm_batches
from tests.models.gpt import TinyGPT, lm_loss
from tests.reference import ADAMW, SGD, check_equal_training, token_batches


def weight_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "harmony-pp", "harmony-dp"])
@pytest.mark.parametrize("swap", ["on", "off"])
def test_schedules_with_swapping_forced_on_and_off_train_like_eager(schedule, swap):
    pipe = check_equal_training(TinyGPT(layers=4), token_batches(), 2, loss_fn=lm_loss, optimizer=ADAMW,
                                microbatches=4, schedule=schedule, swap=swap)
    swapped = sum(s["swap_in_bytes"] for s in pipe.stats)
    assert (swapped > 0) == (swap == "on")


def test_per_device_swapping_trains_like_eager():
    check_equal_training(TinyGPT(layers=2), token_batches(), 2, loss_fn=lm_loss, optimizer=SGD, microbatches=2,
                         schedule="gpipe", swap="per-device")


def test_hf_gpt2_harmony_pp_with_swapping():
    check_equal_training(gpt2(layers=4), lm_batches(), 2, optimizer=ADAMW, microbatches=2, schedule="harmony-pp",
                         swap="on")


def test_model_larger_than_the_devices_trains_within_capacity():
    """Training state (weights, grads, AdamW moments) is 4x the weights; the devices hold half of it.
    (The stashed activations fit beside a pack's state here; tests/test_activation_swap.py swaps them.)"""
    model = TinyGPT(layers=6, dim=96)
    state = 4 * weight_bytes(model)
    capacity = state // 4  # two devices together hold half of the training state
    devices = [sw.Device("cpu", memory=capacity) for _ in range(2)]
    pipe = check_equal_training(model, token_batches(batch=4), devices, loss_fn=lm_loss, optimizer=ADAMW,
                                microbatches=2, schedule="harmony-pp")
    assert pipe.plan.schedule == "harmony-pp" and len(pipe.plan.stages) > 2
    for stats in pipe.stats:
        assert 0 < stats["peak_bytes"] <= capacity
        assert stats["swap_in_bytes"] > 0


def _weight_swap_volume(schedule, swap, devices, microbatches):
    """Bytes of weights swapped in and out during one steady-state iteration (Table 3's regime: no
    weight is tied across packs, so every pack updates right after its backward)."""
    model = TinyGPT(layers=4, tie=False)
    ids = torch.randint(0, 64, (8, 8))
    pipe = sw.compile(model, devices, (ids,), loss_fn=lm_loss, example_target=ids, microbatches=microbatches,
                      schedule=schedule, swap=swap, optimizer=SGD)
    pipe.step(ids, target=ids)
    before = sum(s["swap_weights_bytes"] for s in pipe.stats)
    pipe.step(ids, target=ids)
    return pipe, sum(s["swap_weights_bytes"] for s in pipe.stats) - before, weight_bytes(model)


@pytest.fixture(scope="module")
def swap_volume():
    """`_weight_swap_volume` once per set of arguments: the tests below only read the pipelines."""
    cache: dict = {}

    def get(*args):
        if args not in cache:
            cache[args] = _weight_swap_volume(*args)
        return cache[args]
    return get


def _last_packs_bytes(pipe) -> int:
    """Weights of each device's last pack (on one lane): its forward and backward runs are adjacent,
    so it stays resident in between (Harmony's jit-compute) and saves one swap-in."""
    last: dict[int, object] = {}
    for stage in pipe.plan.stages:
        if stage.replica == 0 and (stage.device not in last or stage.position > last[stage.device].position):
            last[stage.device] = stage
    return sum(pipe.plan.layers[i].param_bytes for s in last.values() for i in s.layers)


def test_swap_volume_harmony_pp_is_three_times_the_weights(swap_volume):
    """Table 3, Harmony PP: 3|W| per iteration (in for F, in for B, out after the jit-update)."""
    pipe, moved, w = swap_volume("harmony-pp", "on", 2, 4)
    assert len(pipe.plan.stages) == 4
    assert moved == 3 * w - _last_packs_bytes(pipe)


def test_swap_volume_harmony_dp_is_three_n_times_the_weights(swap_volume):
    """Table 3, Harmony DP: 3N|W| (each of the N devices runs every pack)."""
    n = 2
    pipe, moved, w = swap_volume("harmony-dp", "on", n, 4)
    assert moved == n * (3 * w - _last_packs_bytes(pipe))


def test_swap_volume_per_device_dp_is_4m_plus_2_n_times_the_weights(swap_volume):
    """Table 3, DP with per-GPU swap: (4m + 2)N|W|, m microbatches per device."""
    n, m = 2, 4
    pipe, moved, w = swap_volume("harmony-dp", "per-device", n, m)
    assert moved == (4 * (m // n) + 2) * n * w
    harmony = swap_volume("harmony-dp", "on", n, m)[1]
    assert moved > 2 * harmony


def _norm_parts(pipe) -> list:
    return [i for p in pipe.programs for i in p.instructions if isinstance(i, GradNormPart)]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "harmony-pp", "harmony-dp"])
def test_clip_grad_norm_with_swapping_trains_like_eager(schedule):
    """The global norm is counted stage by stage (gradients in, part counted, out), summed across
    devices once, and each stage's update scales by it: eager clip_grad_norm_ (the norm ~9, clipped to 0.1)."""
    pipe = check_equal_training(TinyGPT(layers=4), token_batches(), 2, loss_fn=lm_loss, optimizer=ADAMW,
                                microbatches=4, schedule=schedule, swap="on", clip_grad_norm=0.1)
    parts = _norm_parts(pipe)
    assert sorted(i.stage for i in parts) == sorted(s.index for s in pipe.plan.stages)
    updates = [i for p in pipe.programs for i in p.instructions if isinstance(i, (Update, HostUpdate))]
    assert updates and all(isinstance(i, Update) and i.clip for i in updates)
    pipe.simulate()


def test_clip_grad_norm_with_per_device_swapping_trains_like_eager():
    check_equal_training(TinyGPT(layers=2), token_batches(), 2, loss_fn=lm_loss, optimizer=SGD, microbatches=2,
                         schedule="gpipe", swap="per-device", clip_grad_norm=0.5)


def test_hf_gpt2_clip_grad_norm_with_swapping():
    check_equal_training(gpt2(layers=4), lm_batches(), 2, optimizer=ADAMW, microbatches=2, schedule="harmony-pp",
                         swap="on", clip_grad_norm=0.5)


@pytest.mark.parametrize("schedule", ["harmony-pp", "harmony-dp"])
def test_clip_grad_norm_with_one_pack_at_a_time_stays_within_capacity(schedule):
    """The devices hold a quarter of the training state: packs come in one at a time (no double
    buffering), and so does every stage's norm part and update."""
    model = TinyGPT(layers=6, dim=96)
    capacity = weight_bytes(model)  # a quarter of weights + gradients + AdamW moments
    devices = [sw.Device("cpu", memory=capacity) for _ in range(2)]
    pipe = check_equal_training(model, token_batches(batch=4), devices, loss_fn=lm_loss, optimizer=ADAMW,
                                microbatches=2, schedule=schedule, clip_grad_norm=0.1)
    assert len(_norm_parts(pipe)) == len(pipe.plan.stages) > 4
    for stats in pipe.stats:
        assert 0 < stats["peak_bytes"] <= capacity
        assert stats["swap_grads_bytes"] > 0 and stats["swap_optimizer_bytes"] > 0
    pipe.simulate()
