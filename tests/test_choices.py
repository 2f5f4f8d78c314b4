"""Schedules, swap modes and cost models are str enums: the public API takes a member or its string,
plans and their JSON are the same either way, and the library compares members, never literals."""

from __future__ import annotations

import dataclasses
import io
import json
import tokenize
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

import stagewise as sw
from stagewise.compiler.assembly.options import CompileOptions
from stagewise.ir.plan import LayerCost
from stagewise.passes.profile_fit import LayerProfile
from tests.models.mlp import mlp

ROOT = Path(__file__).resolve().parent.parent
LIBRARY = ("cli", "codegen", "compiler", "ir", "passes", "runtime", "stagewise")
ENUM_DEFINITIONS = {ROOT / "ir" / "choices.py", ROOT / "passes" / "swap.py"}
# "auto" is left out: replicas= and stages= take it too, and they are no enums
VALUES = {str(v) for choices in (sw.Schedule, sw.CostModel, sw.SwapMode) for v in choices} - {"auto"}
GPU = dict(memory="80GiB", peak_flops="989TFLOPS", memory_bandwidth="3.35TB/s")


def _plan(**options) -> sw.Plan:
    torch.manual_seed(0)
    x, y = torch.randn(8, 8), torch.randint(0, 5, (8,))
    devices = [sw.Device(f"cuda:{i}", **GPU) for i in range(2)]
    return sw.plan(mlp(), devices, (x,), loss_fn=F.cross_entropy, example_target=y, microbatches=2, **options)


@pytest.mark.parametrize(("option", "text", "member"), [
    ("schedule", "1f1b", sw.Schedule.ONE_F_ONE_B),
    ("schedule", "harmony-pp", sw.Schedule.HARMONY_PP),
    ("swap", "on", sw.SwapMode.ON),
])
def test_a_string_and_its_member_make_the_same_plan(option, text, member):
    by_text, by_member = _plan(**{option: text}), _plan(**{option: member})
    assert by_text.to_json() == by_member.to_json()
    assert type(by_text.schedule) is sw.Schedule and type(by_text.cost_model) is sw.CostModel


@pytest.mark.parametrize(("option", "text", "member"), [
    ("schedule", "varuna", sw.Schedule.VARUNA), ("cost", "analytic", sw.CostModel.ANALYTIC),
    ("swap", "per-device", sw.SwapMode.PER_DEVICE),
])
def test_options_read_a_string_as_its_member(option, text, member):
    options = CompileOptions(**{option: text})
    assert options == CompileOptions(**{option: member}) and type(getattr(options, option)) is type(member)


@pytest.mark.parametrize(("option", "choices", "start"), [
    ("schedule", sw.Schedule, "unknown schedule 'zigzag'"), ("cost", sw.CostModel, "unknown cost='zigzag'"),
    ("swap", sw.SwapMode, "unknown swap='zigzag'"),
])
def test_an_unknown_value_is_an_option_error_listing_the_members(option, choices, start):
    with pytest.raises(sw.OptionError) as caught:
        CompileOptions(**{option: "zigzag"})
    listed = ", ".join(repr(str(member)) for member in choices)
    assert str(caught.value) == f"{start}; choose one of {listed}"


def test_plan_json_keeps_its_text_and_reads_back_as_members():
    plan = _plan(schedule="1f1b")
    data = json.loads(plan.to_json())
    assert data["schedule"] == "1f1b" and data["cost_model"] == "analytic"
    again = sw.Plan.from_json(plan.to_json())
    assert again == plan and type(again.schedule) is sw.Schedule and type(again.cost_model) is sw.CostModel


def test_a_hand_made_plan_written_before_the_enums_reads_back():
    """Before the enums a plan made without a cost model wrote "" for it."""
    plan = dataclasses.replace(_plan(), cost_model=None)
    data = json.loads(plan.to_json())
    data["cost_model"] = ""
    assert sw.Plan.from_json(json.dumps(data)) == plan
    data["schedule"] = "zigzag"
    with pytest.raises(sw.PlanError, match="unknown schedule 'zigzag'"):
        sw.Plan.from_json(json.dumps(data))


def _literals(path: Path) -> list[tuple[int, str]]:
    tokens = tokenize.generate_tokens(io.StringIO(path.read_text()).readline)
    return [(t.start[0], t.string) for t in tokens if t.type == tokenize.STRING and t.string[1:-1] in VALUES
            and t.string[0] == t.string[-1] and len(t.string) > 2]


def test_the_library_compares_members_not_string_literals():
    found = [f"{path.relative_to(ROOT)}:{line}: {text}"
             for package in LIBRARY for path in sorted((ROOT / package).rglob("*.py"))
             if path.resolve() not in ENUM_DEFINITIONS
             for line, text in _literals(path.resolve())]
    assert not found, "use the enum members (ir/choices.py, passes/swap.py):\n" + "\n".join(found)



def test_a_cached_profile_reads_its_source_back_as_a_member():
    """The profile cache is JSON: the cost model comes back from its string."""
    probes = [LayerCost(0, u, 1e-3 * u, 2e-3 * u, 1e-3 * u, 64, 64, 128, 32 * u, 32 * u, 0) for u in (1, 2)]
    profile = LayerProfile.from_probes(SimpleNamespace(index=0, name="fc"), "sig", probes)
    again = LayerProfile.from_dict(json.loads(json.dumps(profile.to_dict())))
    assert again == profile and type(again.source) is sw.CostModel
