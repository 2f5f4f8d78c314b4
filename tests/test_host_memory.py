"""Host memory as a capacity: what a plan keeps in host memory is what the runtime keeps there,
devices of one host share its RAM, a plan its host cannot hold does not fit (and `sw.recommend`
says so), and the training state agrees with the standard 16 bytes per parameter of AdamW.

The model is the test zoo's MLP (P parameters, fp32). With AdamW a parameter's training state is
4 (weights) + 4 (gradients) + 8 (two moments) = 16 bytes, the figure DeepSpeed's ZeRO memory
estimators and Hugging Face accelerate's `estimate-memory` use (ir/costs.py). A swapped stage
keeps all 16 in host memory and its undo record copies the weights and moments, 12 more: 28P.
"""

from __future__ import annotations

import functools
import json
import os

import pytest
import torch
import torch.nn.functional as F

import stagewise as sw
from stagewise.compiler.advice.recommend_report import Out
from stagewise.ir.choices import Schedule
from stagewise.passes.capacity import HostOver
from stagewise.passes.harmony_search import Simulated, _simplest_within_margin
from stagewise.passes.planner import Candidate, Prediction
from tests.models.mlp import mlp

ADAMW = functools.partial(torch.optim.AdamW, lr=1e-3)
X = torch.randn(16, 8, generator=torch.Generator().manual_seed(0))
Y = torch.randint(0, 5, (16,), generator=torch.Generator().manual_seed(1))
PARAMS = sum(p.numel() for p in mlp(width=64).parameters())  # 17,541
STATE = 16 * PARAMS  # AdamW, fp32 parameters: 280,656 bytes
SWAPPED_ON_HOST = 28 * PARAMS  # the state, and the undo copy of weights and moments


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def _kept_on_host(pipe, on_host: bool) -> list[int]:
    """Per device, the host memory the runtime holds between steps: host copies, undo records,
    recycled stash buffers, and a host optimizer's state."""
    guard = pipe._executor.state.guard
    kept = [0] * len(pipe.plan.devices)
    for worker in pipe._workers:
        held = _nbytes(worker.host.values()) + _nbytes(guard.undo[worker.stage.index].memory.values())
        held += sum(buffer.numel() for free in worker.host_bytes.free.values() for buffer, _ in free)
        if on_host:
            held += _nbytes(v for state in worker.optimizer.state.values() for v in state.values())
        kept[worker.stage.device] += held
    return kept


@pytest.mark.parametrize(("swap", "on_host"), [("off", False), ("on", False), ("off", True)])
def test_predicted_host_memory_is_what_the_runtime_keeps(swap, on_host):
    """Between steps the runtime holds all but the gradients sent to host memory (a swapped stage's,
    or the host optimizer's), which live there from the backward to the update."""
    torch.manual_seed(0)
    pipe = sw.compile(mlp(width=64), ["cpu", "cpu"], (X,), loss_fn=F.cross_entropy, example_target=Y,
                      optimizer=ADAMW, microbatches=4, schedule="1f1b", swap=swap, optimizer_on_host=on_host,
                      cost="analytic")
    for _ in range(2):
        pipe.step(X, target=Y)
    in_transit = [_weight_bytes(worker) if swap == "on" or on_host else 0 for worker in pipe._workers]
    kept = _kept_on_host(pipe, on_host)
    for predicted, measured, grads in zip(pipe.plan.predicted_host_bytes, kept, in_transit, strict=True):
        assert measured + grads == pytest.approx(predicted, rel=1e-3)


def _weight_bytes(worker) -> int:
    """A stage's weights (fp32: as many bytes as its gradients), on the device or swapped out."""
    return _nbytes(worker.host.get(("weights", name), param.data) for name, param in worker.params.items())


def _plan(devices, **options):
    return sw.plan(mlp(width=64), devices, (X,), loss_fn=F.cross_entropy, example_target=Y, optimizer=ADAMW,
                   **options)


def test_devices_of_one_host_share_its_ram():
    """Two devices whose state must be swapped keep 28P bytes in host memory together: one host of
    less than that cannot hold the plan, the same RAM on each of two hosts can."""
    each = int(0.6 * SWAPPED_ON_HOST)
    device = functools.partial(sw.Device, "cuda", memory=100_000, peak_flops="1TFLOPS", host_memory=each)
    apart = _plan([device(host=0), device(host=1)], schedule="harmony-pp", swap="on")
    assert sum(apart.predicted_host_bytes) >= SWAPPED_ON_HOST and max(apart.predicted_host_bytes) <= each
    with pytest.raises(sw.CapacityError, match=r"no plan fits the host memory: host 0 would keep .* in its "
                                               r"\d+\.\d KiB of host memory"):
        _plan([device(host=0), device(host=0)], schedule="harmony-pp", swap="on")


def test_the_smallest_ram_a_host_states_bounds_it():
    roomy = sw.Device("cuda", memory=100_000, peak_flops="1TFLOPS", host_memory="1GiB")
    tight = sw.Device("cuda", memory=100_000, peak_flops="1TFLOPS", host_memory=SWAPPED_ON_HOST // 2)
    with pytest.raises(sw.CapacityError, match="host memory"):
        _plan([roomy, tight], schedule="harmony-pp", swap="on")


def test_harmony_search_hands_on_a_configuration_the_devices_hold():
    """When no configuration fits, Alg. 1's pick is the fastest its devices' pools hold (only the
    host's RAM is short), so that the refusal names host memory rather than a faster configuration's
    device overflow (7B on one g6.xlarge said "device 0 would need" before)."""
    def simulated(seconds: float, pools_fit: bool) -> Simulated:
        prediction = Prediction(seconds, (seconds,), (1,), False, hosts_over=(HostOver(0, 2, 1),), pools_fit=pools_fit)
        return Simulated((None, [], 1), prediction)  # type: ignore[arg-type]  # only the prediction is read

    few, many = Candidate(Schedule.HARMONY_PP, 1), Candidate(Schedule.HARMONY_PP, 2)
    scored = [(few, simulated(1.0, pools_fit=False)), (many, simulated(2.0, pools_fit=True))]
    assert _simplest_within_margin(scored, scored[0])[0] == many
    assert _simplest_within_margin(scored[:1], scored[0])[0] == few  # none holds: Alg. 1's own


def test_a_cpu_device_has_this_machines_ram():
    ram = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    assert sw.Device("cpu").spec().host_memory == ram
    assert sw.Device("cpu", host_memory="1GiB").spec().host_memory == 2**30
    assert sw.Device("cuda").spec().host_memory is None  # a GPU planned from elsewhere: say it


def test_adamw_training_state_is_16_bytes_per_parameter():
    """The training state a bf16 plan charges each device (autocast keeps fp32 masters, gradients and
    moments) is 16 bytes per parameter it holds, within 5% of the standard accounting; the host
    keeps the undo copy of weights and moments, 12 bytes per parameter."""
    one = sw.Device("cuda", memory="1GiB", peak_flops="1TFLOPS", host_memory="1GiB")
    plan = _plan([one, one], schedule="gpipe", microbatches=2, precision="bf16")
    layers = plan.costs.layers
    per_device = [[i for stage in plan.stages if stage.device == d for i in stage.layers] for d in range(2)]
    state = [sum(layers[i].state_bytes for i in mine) for mine in per_device]
    params = [sum(layers[i].param_bytes for i in mine) // 4 for mine in per_device]  # fp32 parameters
    assert sum(params) == PARAMS and sum(state) == pytest.approx(STATE, rel=0.05)
    assert all(s == pytest.approx(16 * p, rel=0.05) for s, p in zip(state, params, strict=True))
    assert plan.predicted_host_bytes == tuple(12 * p for p in params)


# ---- sw.recommend on a catalogue worked out by hand ------------------------------------------------

def _catalogue(tmp_path):
    """One 100 kB device per instance (less than the 280,656 bytes of state): "small.1" has 150 kB of
    RAM (device + host 250 kB: cannot hold the state), "large.1" 1 MB; "halfonly.1" a part with no
    bf16 figure but fp16's."""
    figure = {"sources": ["test"]}

    def accelerator(**flops: str) -> dict:
        return {"kind": "cuda", "memory": {"value": 100_000, **figure},
                "memory_bandwidth": {"value": "500GB/s", **figure}, "host_bandwidth": {"value": "16GB/s", **figure},
                "peak_flops": {dtype: {"value": value, **figure} for dtype, value in flops.items()}}

    def instance(name: str, ram: int, price: float) -> dict:
        return {"provider": "test", "accelerator": name, "accelerators": 1, "host_memory": {"value": ram, **figure},
                "on_demand": {"usd_per_hour": price, "region": "test", "sources": ["test"]}}

    data = {"sources": {"test": {"url": "https://example.com/test", "title": "made up for the test",
                                 "accessed": "2026-11-27", "kind": "vendor"}},
            "accelerators": {"GPU": accelerator(bf16="20TFLOPS"), "HALF": accelerator(fp32="5TFLOPS", fp16="40TFLOPS")},
            "instance_types": {"small.1": instance("GPU", 150_000, 1.0), "large.1": instance("GPU", 1_000_000, 2.0),
                               "halfonly.1": instance("HALF", 1_000_000, 3.0)}}
    path = tmp_path / "catalogue.json"
    path.write_text(json.dumps(data))
    return sw.load_catalogue(path)


def test_recommend_never_picks_a_host_that_cannot_hold_the_state(tmp_path):
    found = sw.recommend(mlp(width=64), (X,), loss_fn=F.cross_entropy, example_target=Y, optimizer=ADAMW,
                         catalogue=_catalogue(tmp_path), candidates=["1xsmall.1", "1xlarge.1", "1xhalfonly.1"],
                         precision="bf16")
    rows = {row.request: row for row in found.rows}
    assert found.best is not None and found.best.request == "1xlarge.1"  # the cheapest that holds it
    assert rows["1xsmall.1"].out is Out.MEMORY
    assert rows["1xsmall.1"].why_not.startswith("memory: no plan fits the host memory: host 0 would keep")
    assert rows["1xlarge.1"].plan.predicted_host_bytes[0] >= SWAPPED_ON_HOST
    half = rows["1xhalfonly.1"]
    assert half.meets and half.note == "bf16 timed at the fp16 rate: HALF has no bf16 units"
    assert half.plan.devices[0].peak_flops == 40e12
    cells = " ".join(str(found).replace("│", " ").split())  # the table's words, wrapped cells joined
    assert "out because / note" in cells and "bf16 timed at the fp16 rate: HALF has no bf16 units" in cells
    assert "memory: no plan fits the host memory" in cells
