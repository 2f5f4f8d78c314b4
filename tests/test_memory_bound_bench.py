"""bench/memory_bound.py's every path on the CPU at toy size (the GPU run gets one try): eager,
stagewise on a capped device that must swap, FSDP2 with CPUOffloadPolicy over gloo; all three
train the same model on the same batches, so their losses agree."""

import json
import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import memory_bound  # noqa: E402 - bench/ is no package: on sys.path first


@pytest.fixture(scope="module")
def figures(tmp_path_factory):
    out = tmp_path_factory.mktemp("membound") / "figures.json"
    memory_bound.main(["--device", "cpu", "--layers", "2", "--dim", "32", "--heads", "4", "--vocab", "128",
                       "--seq", "16", "--batch", "4", "--steps", "1", "--headroom-gib", "0", "--fsdp-checkpointing", "on",
                       "--json", str(out)])
    return json.loads(out.read_text())


def test_every_system_trains_the_same_losses(figures):
    rows = {row["system"].split(",")[0]: row for row in figures["rows"]}
    assert set(rows) == {"eager", "stagewise", "FSDP2"} and rows["FSDP2"]["system"].endswith("checkpointing")
    assert [row["error"] for row in rows.values()] == ["", "", ""]
    for row in rows.values():
        assert row["tokens_per_s"] > 0 and math.isfinite(row["last_loss"])
        assert row["last_loss"] == pytest.approx(rows["eager"]["last_loss"], abs=2e-3)  # bf16 compute


def test_stagewise_swaps_under_a_cap_below_eager_need(figures):
    need = figures["need_gib"]
    assert figures["cap_gib"] < need["state_gib"] + need["activations_gib"]
    stagewise = next(row for row in figures["rows"] if row["system"].startswith("stagewise"))
    assert stagewise["extra"]["pcie_gb_per_step"] > 0  # state moved through host memory every step
    assert stagewise["extra"]["pool_peak_gib"] <= figures["cap_gib"]
    assert "bound" in stagewise["bound"]


def test_the_gpu_device_is_the_catalogue_s_with_the_cap():
    """The GPU run's sw.Device, built here (a device need not exist until a runtime uses it)."""
    import _memory_bound_systems as systems

    device = systems.stagewise_device("cuda:0", 12 * 2**30, "H200")
    assert (device.name, device.memory, device.host_memory) == ("cuda:0", 12 * 2**30, None)
    assert device.peak_flops > 5e14 and device.host_bandwidth > 1e10  # bf16 tensor cores, PCIe


def test_a_cap_not_below_eager_need_is_refused():
    args = memory_bound.parse_args(["--device", "cpu", "--cap-gib", "20"])
    with pytest.raises(SystemExit, match="not below eager's need"):
        memory_bound.choose_cap(args, need_gib=19.0, state_gib=10.0)
