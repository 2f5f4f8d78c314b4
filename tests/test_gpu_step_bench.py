"""bench/gpu_step.py runs every path on the CPU at tiny sizes, as it must on the lent GPU the first time:
its rows train the same function (equal losses), stagewise's rows carry a host split and compile
seconds, the JSON holds them; and its GPU busy time is the union of a profiler trace's spans."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest
import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import gpu_step  # noqa: E402 - bench/ is on sys.path only from here


def test_busy_time_counts_overlapping_and_nested_spans_once():
    assert gpu_step.covered_us([(30, 40), (0, 10), (5, 20), (6, 8)]) == 30
    assert gpu_step.covered_us([]) == 0


def test_busy_time_of_a_step_is_within_its_wall_time():
    a = torch.randn(256, 256)
    start = time.perf_counter()
    busy = gpu_step.busy_ms(lambda: float((a @ a).sum()), ProfilerActivity.CPU, DeviceType.CPU)
    wall_ms = (time.perf_counter() - start) * 1e3
    assert busy is not None and 0 < busy <= wall_ms
    assert gpu_step.busy_ms(lambda: 0.0, ProfilerActivity.CPU, DeviceType.CUDA) is None  # no such events


def test_every_row_trains_the_same_function_and_is_written(tmp_path):
    out = tmp_path / "figures.json"
    gpu_step.main(["--device", "cpu", "--no-pin", "--precision", "fp32", "--layers", "3", "--dim", "32",
                   "--vocab", "128", "--length", "8", "--steps", "2", "--warmup", "1", "--json", str(out)])
    rows = {row["row"]: row for row in json.loads(out.read_text())["rows"]}
    assert list(rows) == ["eager", "accum", "sw1", "sw4"]
    for name in ("accum", "sw1", "sw4"):
        assert rows[name]["last_loss"] == pytest.approx(rows["eager"]["last_loss"], rel=1e-5), name
        assert len(rows[name]["step_ms"]) == 2 and rows[name]["to_eager"] > 0
    for name in ("sw1", "sw4"):
        assert rows[name]["compile_s"] > 0 and rows[name]["host"]["compute_ms"] > 0, name
    assert rows["eager"]["host"] is None and rows["sw4"]["gpu_busy_ms"] is None  # on the CPU: "-"
    assert rows["sw4"]["host"]["waiting_ms"] > 0  # 4 stages: the later ones wait for the first


def test_rows_and_precisions_are_parsed_and_refused():
    args = gpu_step.parse_args(["--device", "cpu", "--rows", "sw4,eager", "--precision", "bf16"])
    assert args.rows == [gpu_step.Row.SW4, gpu_step.Row.EAGER] and args.precision == [gpu_step.Precision.BF16]
    assert args.heads == 12  # d=768: GPT-2 small's 12 heads of 64
    with pytest.raises(SystemExit):
        gpu_step.parse_args(["--device", "cpu", "--rows", "eager,pipedream"])
