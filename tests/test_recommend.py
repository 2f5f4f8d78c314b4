"""`sw.recommend` on a small catalogue whose answers can be worked out from the plans themselves.

Two instance types: "slow.1" (one 20 TFLOP/s device, $1/h) and "fast.1" (one 80 TFLOP/s device,
$8/h). Each candidate's iteration time is what `sw.plan` predicts for that device set; the test
derives prices, ranks and the binding constraint from those times by hand and checks that
`recommend` says the same.
"""

from __future__ import annotations

import functools
import json

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

import stagewise as sw
import stagewise.compiler.advice.recommend as recommend_module
from stagewise.catalogue.files import shipped_catalogue
from stagewise.compiler.advice.recommend import default_requests

ADAMW = functools.partial(torch.optim.AdamW, lr=1e-4)
PRICES = {"slow.1": 1.0, "fast.1": 8.0}


def _catalogue(tmp_path, memory: str = "16GB"):
    source = {"url": "https://example.com/test", "title": "a datasheet made up for the test", "accessed": "2026-11-26",
              "kind": "vendor"}

    def accelerator(flops: str) -> dict:
        figure = {"sources": ["test"]}
        return {"kind": "cuda", "memory": {"value": memory, **figure},
                "memory_bandwidth": {"value": "500GB/s", **figure}, "host_bandwidth": {"value": "16GB/s", **figure},
                "peak_flops": {"fp32": {"value": flops, **figure}}}

    def instance(accelerator_name: str, price: float) -> dict:
        return {"provider": "test", "accelerator": accelerator_name, "accelerators": 1,
                "intra_node_bandwidth": {"value": "16GB/s", "sources": ["test"]},
                "inter_node_bandwidth": {"value": "10GB/s", "sources": ["test"]},
                "on_demand": {"usd_per_hour": price, "region": "test", "sources": ["test"]}}

    data = {"sources": {"test": source},
            "accelerators": {"SLOW": accelerator("20TFLOPS"), "FAST": accelerator("80TFLOPS")},
            "instance_types": {"slow.1": instance("SLOW", PRICES["slow.1"]), "fast.1": instance("FAST",
                                                                                                PRICES["fast.1"])}}
    path = tmp_path / "catalogue.json"
    path.write_text(json.dumps(data))
    return sw.load_catalogue(path)


def _model() -> GPT2LMHeadModel:
    config = GPT2Config(n_layer=2, n_embd=256, n_head=4, vocab_size=2048, n_positions=256, bos_token_id=0,
                        eos_token_id=0)
    with torch.device("meta"):
        return GPT2LMHeadModel(config)


def _batch() -> dict:
    ids = torch.randint(0, 2048, (8, 256), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "labels": ids}


CANDIDATES = ["1xslow.1", "2xslow.1", "1xfast.1"]


@pytest.fixture(autouse=True, scope="module")
def plans_once():
    """Every test plans the same model on the same few device sets: each set is planned once (keyed by
    its devices and links) and the plan handed back after; ranking and judging still run each time."""
    memo: dict = {}
    original = recommend_module.planned

    def planned(request, analysis=None):
        key = (tuple(d.spec() for d in request.devices), request.options.topology, request.options.precision)
        if key not in memo:
            memo[key] = original(request, analysis)
        return memo[key]

    recommend_module.planned = planned
    yield
    recommend_module.planned = original


@pytest.fixture(scope="module")
def predicted(tmp_path_factory) -> dict[str, float]:
    """Each candidate's iteration time as sw.plan predicts it on its own (the oracle's input)."""
    catalogue = _catalogue(tmp_path_factory.mktemp("catalogue"))
    times = {}
    for request in CANDIDATES:
        cluster = sw.parse_device_request(request, catalogue)
        topology = sw.Topology.two_level(len(cluster.nodes), 1, "10GB/s", "10GB/s") if len(cluster.nodes) > 1 else None
        times[request] = sw.plan(_model(), list(cluster.devices), _batch(), optimizer=ADAMW,
                                 topology=topology).predicted_iteration_s
    return times


def _usd(request: str, seconds: float, steps: int) -> float:
    count, name = request.split("x", 1)
    return PRICES[name] * int(count) * seconds * steps / 3600


def _recommend(tmp_path, candidates=CANDIDATES, **kwargs) -> sw.Recommendation:
    return sw.recommend(_model(), _batch(), catalogue=_catalogue(tmp_path), candidates=candidates, optimizer=ADAMW,
                        **kwargs)


def test_cost_and_time_rank_as_the_plans_predict(tmp_path, predicted):
    steps = 1000
    by_cost = _recommend(tmp_path, objective="cost", steps=steps)
    want = sorted(CANDIDATES, key=lambda r: _usd(r, predicted[r], steps))
    assert [row.request for row in by_cost.rows] == want
    for row in by_cost.rows:
        assert row.iteration_s == pytest.approx(predicted[row.request])
        assert row.run_usd(steps) == pytest.approx(_usd(row.request, predicted[row.request], steps))
    assert by_cost.best.request == want[0] and not by_cost.unsatisfied
    by_time = _recommend(tmp_path, objective="time", steps=steps)
    assert [row.request for row in by_time.rows] == sorted(CANDIDATES, key=predicted.get)
    assert "recommended: " + by_time.rows[0].request in str(by_time)
    lines = {line.split("│")[2].strip(): [cell.strip() for cell in line.split("│")] for line in str(by_time).splitlines()
             if line.startswith("│")}
    for row in by_time.rows:  # each row says where its time goes and what bounds it
        split = row.plan.predicted_split
        assert lines[row.request][11:13] == [split.percentages(), str(split.bound)]  # after the plan column


def test_a_deadline_rules_out_the_slow_candidates(tmp_path, predicted):
    steps = 1000
    fastest = min(predicted, key=predicted.get)
    deadline = predicted[fastest] * steps * 1.01  # only the fastest makes it
    result = _recommend(tmp_path, objective="cost", steps=steps, deadline_s=deadline)
    assert result.best.request == fastest
    assert all(row.why_not.startswith("deadline:") for row in result.rows if row.request != fastest)


def test_no_candidate_meets_the_deadline_says_by_how_much(tmp_path, predicted):
    steps = 1000
    fastest = min(predicted, key=predicted.get)
    deadline = predicted[fastest] * steps / 2
    result = _recommend(tmp_path, steps=steps, deadline_s=deadline)
    assert result.best is None
    assert result.unsatisfied.startswith(f"deadline: the fastest candidate, {fastest},")
    assert "(100%) over" in result.unsatisfied  # it needs twice the deadline


def test_no_candidate_within_budget_says_by_how_much(tmp_path, predicted):
    steps = 1000
    cheapest = min(CANDIDATES, key=lambda r: _usd(r, predicted[r], steps))
    budget = _usd(cheapest, predicted[cheapest], steps) / 4
    result = _recommend(tmp_path, steps=steps, budget_usd=budget)
    assert result.unsatisfied.startswith(f"budget: the cheapest candidate, {cheapest},")
    assert "(300%) over" in result.unsatisfied


def test_deadline_and_budget_each_met_but_not_together(tmp_path, predicted):
    steps = 1000
    fastest = min(predicted, key=predicted.get)
    cheapest = min(CANDIDATES, key=lambda r: _usd(r, predicted[r], steps))
    assert fastest != cheapest, "the catalogue is meant to make speed and price disagree"
    result = _recommend(tmp_path, steps=steps, deadline_s=predicted[fastest] * steps * 1.01,
                        budget_usd=_usd(cheapest, predicted[cheapest], steps) * 1.01)
    assert result.unsatisfied.startswith("deadline and budget together")


def test_a_model_no_device_holds_is_a_memory_answer(tmp_path):
    result = sw.recommend(_model(), _batch(), catalogue=_catalogue(tmp_path, memory="2MB"), candidates=CANDIDATES,
                          optimizer=ADAMW, steps=10)
    assert result.best is None and result.unsatisfied.startswith("memory:")
    assert all(row.why_not.startswith("memory:") for row in result.rows)


def test_default_candidates_are_priced_instances_in_powers_of_two(tmp_path):
    catalogue = _catalogue(tmp_path)
    ours = [request for request in default_requests(catalogue, 4) if request.split("x", 1)[1] in PRICES]
    assert sorted(ours) == sorted(
        ["1xslow.1", "2xslow.1", "4xslow.1", "1xfast.1", "2xfast.1", "4xfast.1"])
    shipped = default_requests(shipped_catalogue(), 8)
    assert "1xp5.48xlarge" in shipped and "2xp5.48xlarge" not in shipped  # 16 devices > 8


def test_bad_constraints_are_option_errors(tmp_path):
    with pytest.raises(sw.OptionError, match="objective='money'"):
        _recommend(tmp_path, objective="money")
    with pytest.raises(sw.OptionError, match="steps=0"):
        _recommend(tmp_path, steps=0)
    with pytest.raises(sw.OptionError, match="deadline_s=-1"):
        _recommend(tmp_path, deadline_s=-1)


def test_a_probe_replaces_the_datasheet_and_plans_say_so(tmp_path):
    """Srifty §4.2: measured rates of the device one has replace the catalogue's figures for its kind.
    Here the CPU entry (no figures shipped) is probed on this machine's CPU."""
    catalogue = sw.probe_accelerator("CPU", "cpu", catalogue=_catalogue(tmp_path))
    cpu = catalogue.accelerator("CPU")
    assert cpu.measured and not catalogue.accelerator("FAST").measured
    assert cpu.peak_flops.fp32.value > 1e8 and cpu.memory_bandwidth.value > 1e8
    assert all(source.kind.value == "measured" for source in cpu.peak_flops.fp32.sources)
    device = sw.parse_device_request("2xCPU", catalogue).devices[0]
    assert device.peak_flops == cpu.peak_flops.fp32.value and device.memory_bandwidth == cpu.memory_bandwidth.value
    result = sw.recommend(_model(), _batch(), catalogue=catalogue, candidates=["2xCPU", "1xfast.1"], optimizer=ADAMW,
                          objective="time")
    figures = {row.request: row.figures for row in result.rows}
    assert figures == {"2xCPU": "measured", "1xfast.1": "datasheet"}
    assert "measured" in str(result) and "datasheet" in str(result)


def test_a_probe_needs_a_device_of_the_accelerators_kind(tmp_path):
    with pytest.raises(sw.DeviceError, match="is a cuda accelerator but 'cpu' is a cpu device"):
        sw.probe_accelerator("FAST", "cpu", catalogue=_catalogue(tmp_path))


def test_a_heterogeneous_mix_is_planned_and_priced_as_its_parts(tmp_path, predicted):
    """One slow and one fast device: the planner (CP-SAT binding) puts more of the model on the
    fast one, so the mix is no slower than two slow devices; its price is the parts' sum."""
    result = _recommend(tmp_path, candidates=["1xslow.1+1xfast.1", "2xslow.1"], objective="time")
    mix = next(row for row in result.rows if row.request == "1xslow.1+1xfast.1")
    assert mix.devices == 2 and mix.instances == 2 and mix.usd_per_hour == pytest.approx(9.0)
    assert mix.iteration_s <= predicted["2xslow.1"] * 1.001
    assert {d.peak_flops for d in mix.plan.devices} == {20e12, 80e12}


def test_a_misspelt_candidate_fails_at_once(tmp_path):
    with pytest.raises(sw.DeviceError, match="'fats.1' is neither an accelerator nor an instance type"):
        _recommend(tmp_path, candidates=["1xslow.1", "1xfats.1"])
