"""The device catalogue: the shipped figures and their sources, lookups, device requests, user files."""

from __future__ import annotations

import json
import re
import tomllib
from datetime import date
from importlib import resources
from pathlib import Path

import pytest

import stagewise as sw
from stagewise.catalogue.entries import AcceleratorKind, Dtype, SourceKind
from stagewise.catalogue.files import SHIPPED_DATA, shipped_catalogue

ROOT = Path(__file__).resolve().parents[1]
READ_ON = date(2026, 11, 26)  # the day the shipped figures were read
HOST_MEMORY_READ_ON = date(2026, 11, 27)  # the day the instance types' RAM was read

ACCELERATORS = ["H100-SXM-80GB", "H100-PCIe-80GB", "H200-SXM-141GB", "A100-SXM-80GB", "A100-SXM-40GB",
                "A10G-24GB", "L4-24GB", "T4-16GB", "V100-SXM2-16GB", "CPU"]
INSTANCE_TYPES = ["p5.48xlarge", "p4d.24xlarge", "p4de.24xlarge", "g5.xlarge", "g5.12xlarge", "g5.48xlarge",
                  "g6.xlarge", "g6.48xlarge", "g4dn.xlarge", "g4dn.12xlarge", "p3.2xlarge", "p3.16xlarge",
                  "a3-highgpu-8g", "a2-highgpu-1g", "a2-highgpu-8g", "g2-standard-4", "g2-standard-96"]


@pytest.fixture(scope="module")
def shipped() -> sw.Catalogue:
    return sw.load_catalogue()


# ---- the shipped data ---------------------------------------------------------------------------

def test_shipped_catalogue_holds_the_promised_entries(shipped):
    assert shipped.accelerator_names() == sorted(ACCELERATORS)
    assert shipped.instance_type_names() == sorted(INSTANCE_TYPES)
    assert {shipped.instance_type(n).provider for n in INSTANCE_TYPES} == {"aws", "gcp"}


def test_every_shipped_figure_and_price_has_a_dated_source(shipped):
    cited = [*(f for a in shipped.accelerators for f in a.figures()),
             *(f for i in shipped.instance_types for f in i.figures()),
             *(p for i in shipped.instance_types for p in i.prices())]
    assert len(cited) > 60
    for entry in cited:
        assert entry.sources, entry
        for source in entry.sources:
            assert source.url.startswith(("https://", "http://")) and source.title.strip()
            assert READ_ON <= source.accessed <= HOST_MEMORY_READ_ON and isinstance(source.kind, SourceKind)
            assert source.published is None or source.published <= READ_ON


def test_an_entry_without_a_figure_says_why(shipped):
    """A figure that could not be sourced is absent, and the entry's note says so."""
    a10g = shipped.accelerator("A10G")
    assert a10g.peak_flops.dtypes() == () and "no A10G datasheet" in a10g.note
    assert shipped.instance_type("a3-highgpu-8g").on_demand is None
    assert "not recorded" in shipped.instance_type("a3-highgpu-8g").note
    assert all(i.spot is None and "Spot prices vary" in i.note for i in shipped.instance_types)


def test_h100_sxm_figures_are_nvidias_dense_ones(shipped):
    h100 = shipped.accelerator("H100-SXM-80GB")
    assert h100.kind is AcceleratorKind.CUDA
    assert h100.peak_flops.bf16.value == pytest.approx(989.4e12)  # half of the 1,979 with sparsity
    assert h100.peak_flops.fp16.value == pytest.approx(989.4e12)
    assert h100.peak_flops.tf32.value == pytest.approx(494.7e12)
    assert h100.peak_flops.fp32.value == pytest.approx(66.9e12)
    assert h100.memory.value == 80e9 and h100.memory_bandwidth.value == pytest.approx(3.35e12)
    assert h100.host_bandwidth.value == 64e9  # PCIe Gen5 x16 one way, not NVIDIA's two-way 128 GB/s


def test_other_accelerators_figures(shipped):
    a100 = shipped.accelerator("A100-SXM-40GB")
    assert a100.peak_flops.bf16.value == pytest.approx(312e12)
    assert a100.memory_bandwidth.value == pytest.approx(1.555e12)
    assert shipped.accelerator("A100-80GB").memory_bandwidth.value == pytest.approx(2.039e12)
    assert shipped.accelerator("H200").memory.value == 141e9
    assert shipped.accelerator("L4").peak_flops.bf16.value == pytest.approx(121e12)
    t4 = shipped.accelerator("T4")  # Turing has no bf16 or tf32 units
    assert t4.peak_flops.dtypes() == (Dtype.FP32, Dtype.FP16)
    assert t4.peak_flops.fp16.value == pytest.approx(65e12)


def test_instance_types_figures_and_prices(shipped):
    p4d = shipped.instance_type("p4d.24xlarge")
    assert (p4d.accelerator, p4d.accelerators) == ("A100-SXM-40GB", 8)
    assert p4d.intra_node_bandwidth.value == 300e9 and p4d.inter_node_bandwidth.value == 50e9
    assert (p4d.on_demand.usd_per_hour, p4d.on_demand.region) == (32.7726, "us-east-1")
    assert "June 2025" in p4d.on_demand.note or "price cut" in p4d.on_demand.note
    p5 = shipped.instance_type("p5.48xlarge")
    assert p5.inter_node_bandwidth.value == 400e9  # 3,200 Gbit/s
    a2 = shipped.instance_type("a2-highgpu-8g")  # Google bills the GPUs apart from the VM
    assert a2.on_demand.usd_per_hour == pytest.approx(5.91582 + 23.47126)
    assert shipped.instance_type("g2-standard-96").inter_node_bandwidth.value == 12.5e9


def test_every_instance_type_has_its_ram_with_sources(shipped):
    """Host memory is a capacity: every shipped instance type states its RAM, read from its provider."""
    assert all(i.host_memory is not None and i.host_memory in i.figures() for i in shipped.instance_types)
    assert shipped.instance_type("g6.xlarge").host_memory.value == 16 * 2**30
    assert shipped.instance_type("p4d.24xlarge").host_memory.value == 1152 * 2**30
    assert shipped.instance_type("p3.2xlarge").host_memory.value == 61 * 2**30
    a2 = shipped.instance_type("a2-highgpu-1g").host_memory
    assert a2.value == 85e9 and "10^9" in a2.note  # Google's "GB", read as the smaller figure
    assert {s.url for s in shipped.instance_type("g4dn.xlarge").host_memory.sources} >= {
        "https://docs.aws.amazon.com/batch/latest/userguide/gpu-jobs.html"}


def test_the_devices_of_an_instance_share_its_ram():
    cluster = sw.parse_device_request("2xg4dn.12xlarge")
    assert [d.host for d in cluster.devices] == [0] * 4 + [1] * 4
    assert {d.host_memory for d in cluster.devices} == {192 * 2**30}
    assert sw.parse_device_request("4xH100").devices[0].host_memory is None  # packaging unknown


@pytest.mark.parametrize(("request_text", "tflops", "fallback"), [
    ("g4dn.xlarge", 65.0, "fp16"), ("p3.2xlarge", 125.0, "fp16")])
def test_bf16_on_a_part_without_bf16_runs_at_its_fp16_rate(request_text, tflops, fallback):
    cluster = sw.parse_device_request(request_text, precision="bf16")
    assert cluster.devices[0].peak_flops == pytest.approx(tflops * 1e12)
    assert cluster.fallback == f"bf16 timed at the {fallback} rate: {cluster.accelerator.name} has no bf16 units"
    assert sw.parse_device_request("p4d.24xlarge", precision="bf16").fallback == ""


def test_the_data_ships_inside_the_package():
    shipped_file = resources.files("stagewise.catalogue").joinpath(SHIPPED_DATA)
    assert json.loads(shipped_file.read_text(encoding="utf-8"))["schema_version"] == 1
    package_data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    assert SHIPPED_DATA in package_data["stagewise.catalogue"]


# ---- lookups --------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["H100", "h100", "H100-SXM", "h100-sxm-80gb", "H100-SXM5"])
def test_aliases_and_case_find_the_accelerator(shipped, name):
    assert shipped.accelerator(name).name == "H100-SXM-80GB"


def test_instance_type_lookup_ignores_case(shipped):
    assert shipped.instance_type("P4D.24XLARGE").name == "p4d.24xlarge"
    assert shipped.accelerator_of(shipped.instance_type("g6.xlarge")).name == "L4-24GB"


def test_unknown_accelerator_names_it_the_closest_and_the_known_ones(shipped):
    with pytest.raises(sw.DeviceError, match=r"unknown accelerator 'A100'; did you mean 'A100-40GB'.*"
                                             r"known accelerators: A100-SXM-40GB, .*H100-SXM-80GB"):
        shipped.accelerator("A100")


def test_unknown_instance_type(shipped):
    with pytest.raises(sw.DeviceError, match=r"unknown instance type 'p9.48xlarge'.*known instance types: "
                                             r"a2-highgpu-1g.*load_catalogue"):
        shipped.instance_type("p9.48xlarge")


# ---- device requests ------------------------------------------------------------------------------

def test_accelerator_count_request():
    cluster = sw.parse_device_request("8xH100")
    assert [d.name for d in cluster.devices] == [f"cuda:{i}" for i in range(8)]
    assert cluster.nodes == (tuple(range(8)),) and cluster.instance_type is None
    assert cluster.intra_node_bandwidth is None and cluster.inter_node_bandwidth is None
    device = cluster.devices[3]
    assert device.memory == 80_000_000_000 and device.peak_flops == pytest.approx(66.9e12)  # fp32, not tf32
    assert device.memory_bandwidth == pytest.approx(3.35e12) and device.host_bandwidth == 64e9


@pytest.mark.parametrize(("precision", "tflops"), [("fp32", 66.9), ("tf32", 494.7), ("bf16", 989.4),
                                                   (Dtype.FP16, 989.4)])
def test_precision_picks_the_peak_flops(precision, tflops):
    cluster = sw.parse_device_request("2xH100-SXM-80GB", precision=precision)
    assert cluster.precision == Dtype(precision)
    assert all(d.peak_flops == pytest.approx(tflops * 1e12) for d in cluster.devices)


def test_one_instance_request():
    cluster = sw.parse_device_request("p4d.24xlarge", precision="bf16")
    assert len(cluster.devices) == 8 and cluster.nodes == (tuple(range(8)),)
    assert cluster.accelerator.name == "A100-SXM-40GB" and cluster.instance_type.name == "p4d.24xlarge"
    assert cluster.intra_node_bandwidth == 300e9 and cluster.inter_node_bandwidth == 50e9
    assert cluster.devices[0].peak_flops == pytest.approx(312e12) and cluster.devices[0].memory == 40e9


def test_several_instances_request():
    cluster = sw.parse_device_request(" 2 x p4d.24xlarge ")
    assert len(cluster.devices) == 16
    assert cluster.nodes == (tuple(range(8)), tuple(range(8, 16)))
    assert [d.name for d in cluster.devices[8:10]] == ["cuda:0", "cuda:1"]  # names are local to the instance
    assert (cluster.node_of(7), cluster.node_of(9)) == (0, 1)
    with pytest.raises(sw.DeviceError, match="device index 16 is not in this cluster of 16"):
        cluster.node_of(16)


def test_cpu_request_gives_host_cpu_devices():
    cluster = sw.parse_device_request("3xCPU", precision="bf16")
    assert [d.name for d in cluster.devices] == ["cpu"] * 3
    assert all(d.peak_flops is None and d.memory is None for d in cluster.devices)


@pytest.mark.parametrize(("request_text", "message"), [
    ("0xH100", r"the count '0' must be a whole number of at least 1"),
    ("-2xH100", r"the count '-2' must be a whole number of at least 1"),
    ("1.5xH100", r"the count '1.5' must be a whole number"),
    ("8x", r"cannot read device request '8x'; write it like '8xH100'"),
    ("", r"cannot read device request ''"),
    ("8 H100", r"cannot read device request '8 H100'"),
    ("8xFOO", r"'FOO' is neither an accelerator nor an instance type.*accelerators: A100-SXM-40GB.*"
              r"instance types: a2-highgpu-1g"),
    ("p4d", r"'p4d' is neither.*did you mean 'p4d.24xlarge' or 'p4de.24xlarge'"),
    (8, r"device request 8 is a int"),
])
def test_bad_requests(request_text, message):
    with pytest.raises(sw.DeviceError, match=message):
        sw.parse_device_request(request_text)


def test_unknown_precision():
    with pytest.raises(sw.DeviceError, match=r"unknown precision 'fp8'.*'fp32', 'tf32', 'bf16', 'fp16'"):
        sw.parse_device_request("8xH100", precision="fp8")


def test_precision_the_accelerator_lacks():
    with pytest.raises(sw.DeviceError, match=r"no tf32 peak FLOP/s for T4-16GB \(it lists fp32, fp16; Turing.*"
                                             r"peak_flops.tf32 = "):
        sw.parse_device_request("g4dn.12xlarge", precision="tf32")
    with pytest.raises(sw.DeviceError, match=r"no fp32 peak FLOP/s for A10G-24GB \(it lists none; NVIDIA "
                                             r"publishes no A10G datasheet"):
        sw.parse_device_request("g5.xlarge")


# ---- user files -----------------------------------------------------------------------------------

USER_TOML = """
[sources.our-bench]
url = "https://wiki.example.com/gpu-bench"
title = "Our matmul benchmark"
accessed = 2026-11-20
kind = "measured"

[accelerators.H100-SXM-80GB]          # replaces the shipped entry whole
kind = "cuda"
aliases = ["H100"]
memory = { value = "80GiB", sources = ["our-bench"] }
peak_flops.bf16 = { value = "700TFLOPS", sources = ["our-bench"], note = "measured, 4096^3 matmul" }

[accelerators.MY-GPU]
kind = "cuda"
memory = { value = "48GB", sources = ["our-bench"] }
peak_flops.fp32 = { value = "90TFLOPS", sources = ["our-bench"] }

[instance_types."box.2gpu"]
provider = "onprem"
accelerator = "MY-GPU"
accelerators = 2
intra_node_bandwidth = { value = "25GB/s", sources = ["our-bench"] }
host_memory = { value = "64GiB", sources = ["our-bench"] }
on_demand = { usd_per_hour = 3.5, region = "dc1", sources = ["our-bench"] }

[instance_types."box.a100"]
provider = "onprem"
accelerator = "A100-80GB"
accelerators = 4
intra_node_bandwidth = { value = "300GB/s", sources = ["klockwood-a100"] }   # a shipped source id
"""


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_user_toml_overrides_and_adds(tmp_path):
    catalogue = sw.load_catalogue(write(tmp_path, "devices.toml", USER_TOML))
    h100 = catalogue.accelerator("h100")
    assert h100.peak_flops.bf16.value == 700e12 and h100.memory.value == 80 * 2**30
    assert h100.peak_flops.fp32 is None and h100.memory_bandwidth is None  # replaced whole
    assert h100.peak_flops.bf16.sources[0].kind is SourceKind.MEASURED
    assert h100.peak_flops.bf16.sources[0].accessed == date(2026, 11, 20)
    assert shipped_catalogue().accelerator("H100").peak_flops.bf16.value == pytest.approx(989.4e12)
    cluster = sw.parse_device_request("3xbox.2gpu", catalogue=catalogue)
    assert len(cluster.devices) == 6 and cluster.intra_node_bandwidth == 25e9
    assert cluster.devices[0].peak_flops == 90e12 and cluster.instance_type.on_demand.usd_per_hour == 3.5
    assert [(d.host, d.host_memory) for d in cluster.devices[1:3]] == [(0, 64 * 2**30), (1, 64 * 2**30)]
    a100_box = catalogue.instance_type("box.a100")
    assert a100_box.intra_node_bandwidth.sources[0].url.startswith("https://glennklockwood.com")
    assert catalogue.instance_type("p5.48xlarge").accelerators == 8  # shipped entries stay


def test_user_json_adds(tmp_path):
    data = {"schema_version": 1,
            "sources": {"lab": {"url": "https://example.com", "title": "Lab sheet", "accessed": "2026-10-01",
                                "published": "2026-09-30", "kind": "vendor"}},
            "accelerators": {"LAB-CPU": {"kind": "cpu", "peak_flops": {
                "fp32": {"value": 2e12, "sources": ["lab"]}}}},
            "instance_types": {"lab.node": {"provider": "lab", "accelerator": "LAB-CPU", "accelerators": 4,
                                            "inter_node_bandwidth": {"value": "10GB/s", "sources": ["lab"]},
                                            "spot": {"usd_per_hour": 0.5, "region": "lab", "sources": ["lab"],
                                                     "note": "observed 2026-10-01"}}}}
    catalogue = sw.load_catalogue(str(write(tmp_path, "devices.json", json.dumps(data))))
    cluster = sw.parse_device_request("2xlab.node", catalogue=catalogue)
    assert [d.name for d in cluster.devices] == ["cpu"] * 8 and cluster.devices[0].peak_flops == 2e12
    assert cluster.inter_node_bandwidth == 10e9
    assert catalogue.instance_type("lab.node").spot.sources[0].published == date(2026, 9, 30)
    fallback = sw.parse_device_request("lab.node", catalogue=catalogue, precision="bf16")  # no fp16 either
    assert fallback.devices[0].peak_flops == 2e12 and fallback.fallback.startswith("bf16 timed at the fp32 rate")
    with pytest.raises(sw.DeviceError, match=r"no fp16 peak FLOP/s for LAB-CPU \(it lists fp32\)"):
        sw.parse_device_request("lab.node", catalogue=catalogue, precision="fp16")


GOOD_SOURCE = '[sources.s]\nurl = "https://x"\ntitle = "t"\naccessed = 2026-01-01\nkind = "vendor"\n'


@pytest.mark.parametrize(("text", "message"), [
    (GOOD_SOURCE + '[accelerators.G]\nkind = "cuda"\npeak_flops.bf16 = { value = "fast", sources = ["s"] }\n',
     r"accelerators.'G'.peak_flops.bf16.value: cannot read peak_flops 'fast'"),
    (GOOD_SOURCE + '[accelerators.G]\nkind = "cuda"\nmemroy = { value = "1GB", sources = ["s"] }\n',
     r"accelerators.'G': unknown field 'memroy'; the fields are aliases, host_bandwidth, kind, memory"),
    (GOOD_SOURCE + '[accelerators.G]\nkind = "cuda"\npeak_flops.fp64 = { value = "1TFLOPS", sources = ["s"] }\n',
     r"accelerators.'G'.peak_flops: unknown field 'fp64'; the fields are bf16, fp16, fp32, tf32"),
    (GOOD_SOURCE + '[accelerators.G]\nkind = "tpu"\n', r"accelerators.'G'.kind: 'tpu' is not one of cuda, cpu"),
    (GOOD_SOURCE + '[accelerators.G]\nkind = "cuda"\nmemory = { value = "1GB" }\n',
     r"accelerators.'G'.memory: missing field sources"),
    (GOOD_SOURCE + '[accelerators.G]\nkind = "cuda"\nmemory = { value = "1GB", sources = ["nope"] }\n',
     r"accelerators.'G'.memory.sources: no source called 'nope'"),
    (GOOD_SOURCE + '[accelerators.G]\nkind = "cuda"\nmemory = { value = "1GB", sources = [] }\n',
     r"accelerators.'G'.memory.sources: give the ids of one or more"),
    (GOOD_SOURCE + '[accelerators.G]\nkind = "cuda"\naliases = ["H100"]\n',
     r"accelerators 'H100-SXM-80GB' and 'G' both answer to 'H100'"),
    (GOOD_SOURCE + '[instance_types.box]\nprovider = "p"\naccelerator = "NOPE"\naccelerators = 2\n',
     r"instance type 'box' holds accelerator 'NOPE', which the catalogue lacks; known: A100-SXM-40GB"),
    (GOOD_SOURCE + '[instance_types.box]\nprovider = "p"\naccelerator = "T4"\naccelerators = 1\n'
                   'host_memory = { value = "lots", sources = ["s"] }\n',
     r"instance_types.'box'.host_memory.value: cannot read host_memory size 'lots'"),
    (GOOD_SOURCE + '[instance_types.box]\nprovider = "p"\naccelerator = "T4"\naccelerators = 0\n',
     r"instance_types.'box'.accelerators: 0 is not a positive whole number"),
    (GOOD_SOURCE + '[instance_types.box]\nprovider = "p"\naccelerator = "T4"\naccelerators = 1\n'
                   'on_demand = { usd_per_hour = -1, region = "r", sources = ["s"] }\n',
     r"instance_types.'box'.on_demand.usd_per_hour: -1 is not a positive number"),
    (GOOD_SOURCE + '[instance_types."p4d.24xlarge"]\nprovider = "p"\naccelerator = "T4"\naccelerators = 1\n'
                   '[instance_types."P4D.24XLARGE"]\nprovider = "p"\naccelerator = "T4"\naccelerators = 1\n',
     r"'P4D.24XLARGE' is defined twice"),
    ('[sources.s]\nurl = "https://x"\ntitle = "t"\naccessed = "yesterday"\nkind = "vendor"\n',
     r"sources.s.accessed: 'yesterday' is not a date; write it like 2026-11-26"),
    ("schema_version = 2\n", r"schema_version 2 is not one this stagewise reads"),
    ("[accelerators.G\n", r"not valid TOML"),
])
def test_malformed_user_file_names_file_entry_and_field(tmp_path, text, message):
    path = write(tmp_path, "bad.toml", text)
    with pytest.raises(sw.DeviceError, match=rf"catalogue file {re.escape(str(path))}.*{message}"):
        sw.load_catalogue(path)


def test_unreadable_user_files(tmp_path):
    with pytest.raises(sw.DeviceError, match=r"catalogue file .*devices.yaml: a catalogue file is .json or .toml"):
        sw.load_catalogue(write(tmp_path, "devices.yaml", ""))
    with pytest.raises(sw.DeviceError, match=r"missing.json: no such file"):
        sw.load_catalogue(tmp_path / "missing.json")
    with pytest.raises(sw.DeviceError, match=r"list.json: expected a table of fields, got list"):
        sw.load_catalogue(write(tmp_path, "list.json", "[]"))
