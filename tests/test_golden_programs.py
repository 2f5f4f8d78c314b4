"""Golden programs: the instructions each schedule lowers to, one file per schedule in tests/golden/.

A change to lowering, events or the printed form shows up here as a readable diff of programs.txt.
After an intended change, regenerate with `STAGEWISE_UPDATE_GOLDEN=1 python -m pytest tests/test_golden_programs.py`
and read the diff before committing it. Every golden file also parses back into the same programs,
and the parsed programs validate.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import stagewise as sw
from stagewise.ir.program import programs_from_text, validate
from tests.models.gpt import TinyGPT, lm_loss
from tests.reference import ADAMW

GOLDEN = Path(__file__).parent / "golden"

# schedule -> the compile options that exercise what the schedule lowers to (fixed split points and
# analytic costs: the programs do not depend on measurements)
CASES = {
    "gpipe": dict(devices=3, split_points=["blocks.1", "blocks.3"], clip_grad_norm=1.0),
    "1f1b": dict(devices=3, split_points=["blocks.1", "blocks.3"]),
    "zb-h1": dict(devices=3, split_points=["blocks.1", "blocks.3"], clip_grad_norm=1.0),
    "interleaved": dict(devices=2, split_points=["blocks.0", "blocks.2", "blocks.3"]),
    "zb-v": dict(devices=2, split_points=["blocks.0", "blocks.2", "blocks.3"], clip_grad_norm=1.0),
    "varuna": dict(devices=3, split_points=["blocks.1", "blocks.3"]),
    "harmony-pp": dict(devices=2, split_points=["blocks.0", "blocks.2", "blocks.3"], swap="on", clip_grad_norm=1.0),
    "harmony-dp": dict(devices=2, split_points=["blocks.2"], swap="on"),
}


def compiled_programs(schedule: str) -> str:
    torch.manual_seed(0)
    ids = torch.randint(0, 64, (8, 16))
    options = dict(CASES[schedule])
    devices = [sw.Device("cpu") for _ in range(options.pop("devices"))]
    pipe = sw.compile(TinyGPT(), devices, (ids,), loss_fn=lm_loss, example_target=ids, optimizer=ADAMW,
                      schedule=schedule, microbatches=4, cost="analytic", **options)
    return "\n".join(str(p) for p in pipe.programs) + "\n"


@pytest.mark.parametrize("schedule", sorted(CASES))
def test_programs_match_golden(schedule: str) -> None:
    text = compiled_programs(schedule)
    path = GOLDEN / f"{schedule}.txt"
    if os.environ.get("STAGEWISE_UPDATE_GOLDEN"):
        path.parent.mkdir(exist_ok=True)
        path.write_text(text)
    assert path.exists(), f"no golden file {path}; run with STAGEWISE_UPDATE_GOLDEN=1 to write it"
    assert text == path.read_text(), f"{schedule}'s programs changed: regenerate and review the diff"


@pytest.mark.parametrize("schedule", sorted(CASES))
def test_golden_programs_parse_back_and_validate(schedule: str) -> None:
    text = (GOLDEN / f"{schedule}.txt").read_text()
    programs = programs_from_text(text)
    assert "\n".join(str(p) for p in programs) + "\n" == text
    validate(programs)
