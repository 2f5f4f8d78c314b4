"""Every byte on the link it crosses (issue 24 item 1, item 7's PCIe bound).

Swaps and stashes cross the device's host link (PCIe), shared by the devices of one host; sends
cross the link to their peer; all-reduces a ring over their group. For every instruction kind that
moves bytes (found from its `Facts`, so a new kind is covered), doubling its bytes or halving its
link doubles the transfer part of its simulated span. A plan that swaps on one GPU pays its PCIe
copies (they were free: the swap link was the slowest link between devices, none for one device),
two one-GPU machines swap over their PCIe, not their network, and an iteration is never shorter
than the bytes it moves over a host link over that link's bandwidth.
"""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

import stagewise as sw
from stagewise.compiler.advice.device_mix import mix_of
from stagewise.ir.instruction_facts import Link
from stagewise.ir.instructions import KINDS, Carried, Instruction, Recv, Send, State, SwapIn, SwapOut
from stagewise.ir.program import Program
from stagewise.passes.simulate import SimCost, SimResult, Span, simulate
from tests.models.mlp import mlp

MB = 2.0**20
LATENCY_S, INSTRUCTION_S = 1e-4, 3e-5  # fixed costs beside the transfer, so the test isolates it
FIELDS = {"stage": 0, "microbatch": 0, "state": State.WEIGHTS, "nbytes": int(MB), "group": (0, 1),
          "tensors": ("w",), "carries": Carried.ACTIVATIONS, "peer": 1, "peer_stage": 1, "values": ("v",)}


def _make(kind: type[Instruction], **given) -> Instruction:
    """An instruction of `kind` with every field it has from FIELDS (a new field fails here: add it)."""
    names = {f.name for f in dataclasses.fields(kind) if f.name != "waits"}
    return kind(**{name: given.get(name, FIELDS[name]) for name in names})


def _programs(kind: type[Instruction], nbytes: int) -> tuple[Program, ...]:
    """The smallest programs in which `kind` runs: alone on a host link, a send and its receive, or
    an all-reduce on both devices of its group."""
    link = kind.facts.crosses
    if link is Link.HOST:
        return (Program(0, (_make(kind, nbytes=nbytes),)),)
    if link is Link.PEER:
        return (Program(0, (_make(Send),)),
                Program(1, (_make(Recv, stage=1, peer=0, peer_stage=0),)))
    assert link is Link.RING, f"{kind.__name__} crosses {link}: build its programs here"
    return Program(0, (_make(kind, stage=0),)), Program(1, (_make(kind, stage=1),))


def _cost(nbytes: float, host: float, between: float) -> SimCost:
    """Every source of bytes at `nbytes` (the plan's or the cost model's, as each kind reads them),
    each device's host link at `host` bytes/s and the links between devices at `between`."""
    return SimCost((0.0, 0.0), (0.0, 0.0), stash_bytes=(nbytes, nbytes), value_bytes={"v": nbytes},
                   tensor_bytes={"w": nbytes}, bandwidth=between, host_links={0: host, 1: host}, hosts={0: 0, 1: 1},
                   latency_s=LATENCY_S, instruction_s=INSTRUCTION_S)


def _transfer_s(kind: type[Instruction], nbytes: float, bandwidth: float) -> float:
    """The transfer part of the one `kind` instruction's simulated span (a ring's: the same on each
    member): its span less the latency and runtime cost it has over a free link. Only the link
    `kind` says it crosses has `bandwidth`; the other is 10x faster, so a kind charged on the wrong
    link shows."""
    spans = []
    for link in (bandwidth, math.inf):
        host, between = (link, 10 * bandwidth) if kind.facts.crosses is Link.HOST else (10 * bandwidth, link)
        result = simulate(_programs(kind, int(nbytes)), _cost(nbytes, host, between))
        (seconds,) = {s.end - s.start for s in result.timeline if type(s.instruction) is kind}
        spans.append(seconds)
    return spans[0] - spans[1]


def _bytes(kind: type[Instruction], nbytes: float) -> float:
    """What the simulator reads as the bytes `kind` moves when every source holds `nbytes`."""
    return _cost(nbytes, 1.0, 1.0).bytes_of(_make(kind, nbytes=int(nbytes)))


MOVERS = [kind for kind in KINDS if kind.facts.crosses is not None]


def test_the_byte_moving_kinds_are_found_from_their_facts():
    assert {k.__name__ for k in MOVERS} == {"AllReduceShared", "AllReduceGradNorm", "Send", "Recv", "SwapIn",
                                           "SwapOut", "StashIn", "StashOut"}


@pytest.mark.parametrize("kind", MOVERS, ids=lambda k: k.__name__)
def test_doubling_bytes_or_halving_the_link_doubles_the_transfer(kind: type[Instruction]):
    """The transfer is its bytes over the link it crosses (a ring of two: 2 (n - 1) / n = 1 times
    them), and twice that over half the link or with twice the bytes."""
    bandwidth = 1e9
    transfer = _transfer_s(kind, MB, bandwidth)
    assert transfer == pytest.approx(_bytes(kind, MB) / bandwidth, rel=1e-9) and transfer > 0
    assert _transfer_s(kind, MB, bandwidth / 2) == pytest.approx(2 * transfer, rel=1e-9)
    if _bytes(kind, 2 * MB) == 2 * _bytes(kind, MB):  # all but the norm's all-reduce: always 8 bytes
        assert _transfer_s(kind, 2 * MB, bandwidth) == pytest.approx(2 * transfer, rel=1e-9)


@pytest.mark.parametrize(("hosts", "inbound_both", "expected"),
                         [({0: 0, 1: 0}, True, 2.0), ({0: 0, 1: 1}, True, 1.0), ({0: 0, 1: 0}, False, 1.0)],
                         ids=["one-host-shares", "two-hosts", "in-and-out-apart"])
def test_devices_of_one_host_share_its_link_per_direction(hosts, inbound_both: bool, expected: float):
    """Two devices swapping MB at once: behind one host each gets half of it (Srifty §4.3's fair
    share); behind two hosts, or in opposite directions (PCIe is duplex), each its whole link."""
    second = SwapIn if inbound_both else SwapOut
    programs = (Program(0, (SwapIn(0, State.WEIGHTS, int(MB)),)), Program(1, (second(1, State.WEIGHTS, int(MB)),)))
    cost = SimCost((0.0, 0.0), (0.0, 0.0), host_links={0: MB, 1: MB}, hosts=hosts)
    spans = [s.end - s.start for s in simulate(programs, cost).timeline]
    assert spans == pytest.approx([expected, expected])


# ---- plans: the cost phase puts each device's host link on the swaps ----------------------------
def _plan(devices, topology=None, swap: str = "on") -> sw.Plan:
    x, y = torch.randn(16, 8), torch.randint(0, 5, (16,))
    return sw.plan(mlp(width=512, depth=6), devices, (x,), loss_fn=torch.nn.functional.cross_entropy,
                   example_target=y, microbatches=2, swap=swap, topology=topology, schedule="gpipe")


def _catalogue(tmp_path) -> sw.Catalogue:
    """One-GPU instances whose PCIe link (16 GB/s) is 16 times their network (1 GB/s); h.1 has no
    network figure (sw.plan's default link between its instances)."""
    figure = {"sources": ["test"]}
    source = {"url": "https://example.com/test", "title": "made up for the test", "accessed": "2026-11-27",
              "kind": "vendor"}
    data = {"sources": {"test": source},
            "accelerators": {"G": {"kind": "cuda", "memory": {"value": "16GB", **figure},
                                   "memory_bandwidth": {"value": "500GB/s", **figure},
                                   "host_bandwidth": {"value": "16GB/s", **figure},
                                   "peak_flops": {"fp32": {"value": "20TFLOPS", **figure}}}},
            "instance_types": {"g.1": {"provider": "test", "accelerator": "G", "accelerators": 1,
                                       "inter_node_bandwidth": {"value": "1GB/s", **figure},
                                       "on_demand": {"usd_per_hour": 1.0, "region": "test", **figure}},
                               "h.1": {"provider": "test", "accelerator": "G", "accelerators": 1}}}
    path = tmp_path / "catalogue.json"
    path.write_text(json.dumps(data))
    return sw.load_catalogue(path)


def _swap_spans(result: SimResult) -> list[Span]:
    return [s for s in result.timeline if s.instruction.facts.crosses is Link.HOST]


@pytest.mark.parametrize(("request_", "instances"), [("g.1", 1), ("2xg.1", 2), ("g.1+g.1", 2), ("2xh.1", 2)],
                         ids=["one-gpu", "two-one-gpu-instances", "a-mix-of-two", "no-network-figure"])
def test_a_swap_crosses_the_catalogue_pcie_link_not_the_network(tmp_path, request_: str, instances: int):
    """One g.1 used to swap for free (no link between devices), two at their 1 GB/s network: each
    swap now takes its bytes over the accelerator's 16 GB/s host link (alone on it: one device per
    host, one swap stream per direction)."""
    mix = mix_of(request_, _catalogue(tmp_path), "fp32")
    plan = _plan(mix.devices, mix.topology())
    assert plan.costs is not None and plan.costs.topology.host_links == (16e9,) * instances
    assert [plan.costs.topology.host_of(d) for d in range(instances)] == list(range(instances))  # an instance each
    loaded = sw.Plan.from_json(plan.to_json())  # a loaded plan predicts the same (plan.json keeps the links)
    assert loaded.costs is not None and loaded.costs.topology == plan.costs.topology
    result = sw.simulate(plan)
    spans = _swap_spans(result)
    assert spans and sum(result.swap_in_bytes.values()) > 0
    instruction_s = plan.costs.runtime.instruction_s
    for span in spans:
        if isinstance(span.instruction, SwapIn | SwapOut):
            assert span.end - span.start == pytest.approx(span.instruction.nbytes / 16e9 + instruction_s, rel=1e-6)


@pytest.mark.parametrize("devices", [1, 2], ids=["one-device", "two-devices-one-host"])
def test_an_iteration_is_at_least_its_host_bytes_over_the_host_link(devices: int):
    """Item 7's bound on a PCIe-bound plan: devices of tiny memory behind a 1 GB/s host link must
    swap; the predicted iteration is at least each host's bytes in one direction over its link."""
    gpu = sw.Device("cuda", memory="3MiB", peak_flops="100TFLOPS", memory_bandwidth="2TB/s", host_bandwidth="1GB/s")
    plan = _plan([gpu] * devices, swap="auto")
    result = sw.simulate(plan)
    moved_in, moved_out = sum(result.swap_in_bytes.values()), sum(result.swap_out_bytes.values())
    assert moved_in > 0 and moved_out > 0
    assert result.iteration_time >= max(moved_in, moved_out) / 1e9
