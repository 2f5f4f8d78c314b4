"""`sw.plan`: planning for hardware this machine does not have, without weights or a runtime.

Every cost is modelled from the devices' figures (nothing is timed here: the calibration probes
are made to fail), a model on the meta device plans like the same model with weights, and the
prediction respects the roofline bound it is built on.
"""

from __future__ import annotations

import functools
import threading

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

import stagewise as sw
from stagewise.compiler.compile.modelled_costs import INSTRUCTION_S, KERNEL_S, update_traffic

H100 = dict(memory="80GiB", peak_flops="989TFLOPS", memory_bandwidth="3.35TB/s")
ADAMW = functools.partial(torch.optim.AdamW, lr=1e-4)


def _gpt2(layers: int = 4, meta: bool = False) -> GPT2LMHeadModel:
    config = GPT2Config(n_layer=layers, n_embd=128, n_head=4, vocab_size=1024, n_positions=128,
                        bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    if meta:
        with torch.device("meta"):
            return GPT2LMHeadModel(config)
    return GPT2LMHeadModel(config)


def _batch(size: int = 16, length: int = 64) -> dict:
    ids = torch.randint(0, 1024, (size, length), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "labels": ids}


@pytest.fixture
def nothing_timed_here(monkeypatch):
    """Every probe of this machine (device calibration, send bandwidth, optimizer and hand-off timing)
    fails: a plan for other hardware must not use them."""
    def refuse(*args, **kwargs):
        raise AssertionError("sw.plan timed something on the planning machine")

    for name in ("_calibrate", "send_bandwidth", "optimizer_cost", "handoff_seconds", "local_topology"):
        monkeypatch.setattr(f"stagewise.compiler.compile.calibrate.{name}", refuse, raising=False)
    for name in ("optimizer_cost", "handoff_seconds", "local_topology"):
        monkeypatch.setattr(f"stagewise.compiler.compile.costing.{name}", refuse)


def test_plans_for_gpus_this_machine_lacks_without_timing_or_running_anything(nothing_timed_here):
    streams_before = {t for t in threading.enumerate() if t.name.startswith("dev")}  # earlier pipelines'
    devices = [sw.Device(f"cuda:{i}", **H100) for i in range(4)]
    plan = sw.plan(_gpt2(), devices, _batch(), optimizer=ADAMW, schedule="1f1b", microbatches=4)
    assert isinstance(plan, sw.Plan)
    assert [d.kind for d in plan.devices] == ["cuda"] * 4 and plan.devices[0].peak_flops == 989e12
    assert plan.predicted_iteration_s > 0 and plan.programs
    streams = {t for t in threading.enumerate() if t.name.startswith("dev")}
    assert streams <= streams_before  # no runtime: no stream threads of its own
    assert plan.costs.runtime.instruction_s == INSTRUCTION_S
    timeline = sw.simulate(plan)
    assert timeline.iteration_time == pytest.approx(plan.predicted_iteration_s)


def test_a_meta_device_model_plans_as_the_same_model_with_weights(nothing_timed_here):
    devices = [sw.Device(f"cuda:{i}", **H100) for i in range(4)]
    with_weights = sw.plan(_gpt2(), devices, _batch(), optimizer=ADAMW)
    meta = _gpt2(meta=True)
    assert all(p.is_meta for p in meta.parameters())
    shapes_only = sw.plan(meta, devices, _batch(), optimizer=ADAMW)
    assert shapes_only.stages == with_weights.stages and shapes_only.programs == with_weights.programs
    assert shapes_only.predicted_iteration_s == with_weights.predicted_iteration_s
    assert shapes_only.predicted_peak_bytes == with_weights.predicted_peak_bytes


def test_the_update_is_modelled_as_state_streamed_through_the_devices_memory(nothing_timed_here):
    """AdamW reads a weight, its gradient and two moments and writes three: 7 weight-sized passes."""
    plan = sw.plan(_gpt2(), [sw.Device(f"cuda:{i}", **H100) for i in range(2)], _batch(), optimizer=ADAMW,
                   microbatches=2, schedule="gpipe")
    assert update_traffic(2.0) == 7.0 and update_traffic(0.0) == 3.0
    model = _gpt2()
    params = dict(model.named_parameters(remove_duplicate=False))  # a tied weight under each name
    for layer, seconds in zip(plan.layers, plan.costs.runtime.update_s, strict=True):
        tensors = [params[_model_name(name, params)] for name in layer.params]
        nbytes = sum(p.numel() * 4 for p in tensors)
        assert seconds == pytest.approx(len(tensors) * KERNEL_S + nbytes * 7.0 / 3.35e12)


def _model_name(graph_name: str, params: dict) -> str:
    """A layer lists its parameters under the graph's names (dots, or underscores for export)."""
    if graph_name in params:
        return graph_name
    return next(name for name in params if name.replace(".", "_") == graph_name.replace(".", "_"))


def test_the_prediction_is_not_faster_than_the_roofline(nothing_timed_here):
    """6 x parameters x tokens FLOPs over the devices' peak is a lower bound on a training step."""
    model, batch, devices = _gpt2(layers=6), _batch(32, 128), [sw.Device(f"cuda:{i}", **H100) for i in range(4)]
    plan = sw.plan(model, devices, batch, optimizer=ADAMW, precision="bf16")
    params = sum(p.numel() for p in model.parameters())
    tokens = batch["input_ids"].numel()
    roofline_s = 6 * params * tokens / (len(devices) * 989e12)
    assert plan.predicted_iteration_s > roofline_s
    assert plan.precision == "bf16"


def test_faster_links_given_as_a_topology_predict_no_slower(nothing_timed_here):
    devices = [sw.Device(f"cuda:{i}", **H100) for i in range(4)]
    options = dict(optimizer=ADAMW, schedule="1f1b", microbatches=8, split_points=["transformer.h.0",
                                                                                  "transformer.h.1",
                                                                                  "transformer.h.2"])
    pcie = sw.plan(_gpt2(), devices, _batch(), **options)
    nvlink = sw.plan(_gpt2(), devices, _batch(), topology=sw.Topology.uniform(4, "450GB/s"), **options)
    assert nvlink.costs.topology.slowest_link == 450e9 and pcie.costs.topology.slowest_link == 25e9
    assert nvlink.predicted_iteration_s < pcie.predicted_iteration_s


def test_a_topology_of_another_size_is_an_option_error():
    devices = [sw.Device(f"cuda:{i}", **H100) for i in range(4)]
    with pytest.raises(sw.OptionError, match="describes 2 devices but 4 were given"):
        sw.plan(_gpt2(), devices, _batch(), topology=sw.Topology.uniform(2, "25GB/s"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
def test_compile_still_needs_the_devices_it_runs_on():
    with pytest.raises(sw.DeviceError, match="asks for CUDA but this machine has none"):
        sw.compile(_gpt2(), [sw.Device("cuda:0", **H100)], _batch(), cost="analytic")


def test_compile_refuses_a_meta_device_model_and_names_sw_plan():
    with pytest.raises(sw.ExampleInputsError, match="sw.plan plans a meta-device model"):
        sw.compile(_gpt2(meta=True), 2, _batch(), cost="analytic")
