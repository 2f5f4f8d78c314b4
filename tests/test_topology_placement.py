"""Placement by topology (issue 26 item 2): on 2 hosts x 2 devices with a fast link inside each host
and a slow one between them, a P = 2 x D = 2 plan keeps each stage's two data-parallel copies on
one host (their gradient all-reduce on the fast link, the activations across hosts: Narayanan et
al. §3), because the simulator, charging every all-reduce and send on the link it crosses,
predicts it faster than each pipeline copy on its own host. Planned with `sw.plan` for described
devices: nothing runs, no process is started. Under torchrun with tensor_parallel=T, the topology
is the P pipeline devices' (device d on its T ranks' host), from a faked gather of host names."""

from __future__ import annotations

import functools
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import stagewise as sw
from stagewise.compiler.compile import cluster
from stagewise.compiler.compile.cluster import hosts_topology

GPU = dict(memory="16GiB", peak_flops="20GFLOPS", memory_bandwidth="100GB/s")  # slow enough that two stages pay
TWO_HOSTS = sw.Topology.two_level(servers=2, per_server=2, intra="100GB/s", inter="125MB/s")  # 1 Gbit/s between
GROUPED = "stage copies together"  # how the planner's table of candidates names the grouping


def _wide_mlp() -> nn.Sequential:
    """Large weights and small activations: the all-reduce, not the sends, is what the link costs."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 1024), nn.Tanh(), nn.Linear(1024, 1024), nn.Tanh(),
                         nn.Linear(1024, 1024), nn.Tanh(), nn.Linear(1024, 8))


def _plan(topology: sw.Topology, **options) -> sw.Plan:
    x, y = torch.randn(16, 64), torch.randint(0, 8, (16,))
    return sw.plan(_wide_mlp(), [sw.Device(f"cuda:{i}", **GPU) for i in range(4)], (x,), loss_fn=F.cross_entropy,
                   example_target=y, optimizer=functools.partial(torch.optim.SGD, lr=0.1), schedule="1f1b", topology=topology,
                   microbatches=4, **options)


def _hosts_of_each_stage(plan: sw.Plan, topology: sw.Topology) -> dict[int, set[int]]:
    hosts: dict[int, set[int]] = {}
    for stage in plan.stages:
        hosts.setdefault(stage.logical, set()).add(topology.host_of(stage.device))
    return hosts


def _predicted_ms(plan: sw.Plan, grouped: bool) -> float:
    rows = [row for row in plan.considered if "D=2 P=2" in row and (GROUPED in row) == grouped]
    assert len(rows) == 1, plan.considered
    return float(rows[0].split("ms/iteration")[0].split()[-1])


@pytest.mark.parametrize("search", [dict(replicas=2, stages=2), dict(replicas="auto", stages="auto")],
                         ids=["P2xD2-asked", "searched"])
def test_two_hosts_keep_each_stages_copies_on_one_host_which_predicts_faster(search):
    plan = _plan(TWO_HOSTS, **search)
    assert _hosts_of_each_stage(plan, TWO_HOSTS) == {0: {0}, 1: {1}}, [(s.logical, s.device) for s in plan.stages]
    grouped, by_pipeline = _predicted_ms(plan, grouped=True), _predicted_ms(plan, grouped=False)
    assert grouped < by_pipeline / 2, plan.considered  # 1 Gbit/s against 100 GB/s: the all-reduce dominates
    assert plan.predicted_iteration_s * 1e3 == pytest.approx(grouped, abs=0.01)


def test_one_host_plans_as_before_without_a_second_grouping():
    flat = sw.Topology.uniform(4, "125MB/s")  # the same devices, one flat level: the topology-blind view
    plan = _plan(flat, replicas=2, stages=2)
    assert plan.considered == ()  # one candidate, as asked: no grouping to weigh on one host
    assert [(s.logical, s.device) for s in sorted(plan.stages, key=lambda s: s.index)] == [(0, 0), (1, 1), (0, 2), (1, 3)]


def test_the_link_inside_a_host_is_the_one_measured_between_two_of_its_ranks():
    """Under torchrun the ranks of one host talk over the process group's transport (gloo: TCP over
    loopback), not the in-process copy `local_topology` times: cluster.py measures it and the
    host level carries it, for levels and for a bare matrix alike."""
    local = sw.Topology.uniform(4, 25e9)  # the in-process copy's bandwidth
    grouped = hosts_topology(["a", "a", "b", "b"], local, between=1.2e8, inside=1.5e9)
    assert grouped.link(0, 1) == 1.5e9 and grouped.link(1, 2) == 1.2e8
    mixed = hosts_topology(["a", "b", "a", "b"], local, between=1.2e8, inside=1.5e9)
    assert mixed.link(0, 2) == 1.5e9 and mixed.link(0, 1) == 1.2e8
    assert hosts_topology(["a", "a", "b", "b"], local, between=1.2e8).link(0, 1) == 25e9  # not measured: the copy's


BETWEEN, INSIDE = 1.2e8, 1.5e9  # bytes/s the fake probe reports across hosts and within rank 0's


def _cluster(monkeypatch, rank_hosts: list[str], devices: int, tensor_parallel: int) -> tuple[sw.Topology, list]:
    """cluster_topology on a faked job: each rank's host name gathered, each probe's peer recorded."""
    timed: list[int] = []

    def probe(peer: int, device) -> float:
        timed.append(peer)
        return INSIDE if rank_hosts[peer] == rank_hosts[0] else BETWEEN

    fake = SimpleNamespace(get_world_size=lambda: len(rank_hosts), get_backend=lambda: "gloo",
                           all_gather_object=lambda out, _: out.__setitem__(slice(None), rank_hosts),
                           broadcast_object_list=lambda box, src: None)
    monkeypatch.setattr(cluster, "dist", fake)
    monkeypatch.setattr(cluster, "local_topology", lambda given: sw.Topology.uniform(len(given), 25e9))
    monkeypatch.setattr(cluster, "_round_trip_bandwidth", probe)
    return cluster.cluster_topology(["cpu"] * devices, 0, tensor_parallel), timed


@pytest.mark.parametrize(("rank_hosts", "tensor_parallel", "peers", "links"), [
    (["a", "a", "b", "b"], 2, [2], {(0, 1): BETWEEN}),  # T = 2 x P = 2: one device per host
    (["a"] * 4 + ["b"] * 4, 2, [4, 2], {(0, 1): INSIDE, (1, 2): BETWEEN, (2, 3): INSIDE}),
    (["a", "a", "b", "b"], 1, [2, 1], {(0, 1): INSIDE, (1, 2): BETWEEN}),  # T = 1 as before
])
def test_tensor_parallel_hosts_give_the_pipeline_devices_topology(monkeypatch, rank_hosts, tensor_parallel, peers,
                                                                   links):
    """The planner gets P devices (not T·P ranks), each on its T ranks' host, and the links timed
    are between two devices' position-0 ranks, which a pipeline's p2p crosses."""
    devices = len(rank_hosts) // tensor_parallel
    topology, timed = _cluster(monkeypatch, rank_hosts, devices, tensor_parallel)
    assert topology.n_devices == devices and timed == peers
    assert {pair: topology.link(*pair) for pair in links} == links


def test_a_tensor_parallel_group_across_hosts_is_refused(monkeypatch):
    with pytest.raises(sw.DeviceError, match=r"device 0's ranks \[0, 1\] are on several hosts.*nproc-per-node"):
        _cluster(monkeypatch, ["a", "b", "a", "b"], 2, 2)
    with pytest.raises(sw.DeviceError, match="need 4 processes, but this job has 6"):
        _cluster(monkeypatch, ["a"] * 3 + ["b"] * 3, 2, 2)
