"""PipeDream's DP with replication in the product's terms: a replication given (replicas=(2, 1)) is
cut optimally, a replicated plan is placed on devices server by server, and the topology of a
torch.distributed job gets a level per host (PipeDream Fig. 2.6)."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from stagewise.compiler.compile.cluster import host_levels, hosts_topology
from stagewise.ir.topology import Level, Topology
from stagewise.passes.pipedream_dp import (
    LayerCosts,
    NoFeasiblePlan,
    StageSpan,
    plan_pipeline,
    plan_with_replicas,
)
from tests.pipedream_oracle import bottleneck_time


def random_costs(rng: random.Random, n: int) -> LayerCosts:
    return LayerCosts(compute=[rng.randint(1, 12) for _ in range(n)],
                      activation_bytes=[rng.choice([0, 1, 4, 10, 30]) for _ in range(n)],
                      param_bytes=[rng.randint(0, 20) for _ in range(n)], stash_bytes=[rng.randint(0, 6) for _ in range(n)],
                      resident_bytes=[rng.randint(1, 20) for _ in range(n)],
                      cut_allowed=[rng.random() < 0.8 for _ in range(n - 1)])


def splits(n: int, cut_allowed, parts: int):
    """Every split of layers 0..n-1 into `parts` contiguous ranges, cutting only where allowed."""
    gaps = [g for g in range(n - 1) if cut_allowed is None or cut_allowed[g]]
    for chosen in itertools.combinations(gaps, parts - 1):
        yield list(zip([0] + [c + 1 for c in chosen], [*chosen, n - 1], strict=True))


@pytest.mark.parametrize("seed", range(25))
def test_plan_with_replicas_equals_brute_force(seed: int) -> None:
    """For a replication given, the cuts with the least bottleneck under the DP's model."""
    rng = random.Random(500 + seed)
    costs = random_costs(rng, rng.randint(2, 6))
    replicas = tuple(rng.randint(1, 3) for _ in range(rng.randint(1, 3)))
    topology = Topology.uniform(sum(replicas) + rng.randint(0, 1), rng.choice([1.0, 5.0]))
    memory = rng.choice([None, 60.0])
    flat = Topology.uniform(sum(replicas), topology.slowest_link)
    best = min((bottleneck_time([StageSpan(a, b, r) for (a, b), r in zip(ranges, replicas, strict=True)], costs, flat,
                                memory=memory)
                for ranges in splits(costs.n_layers, costs.cut_allowed, len(replicas))),
               default=math.inf)
    if best == math.inf:
        with pytest.raises(NoFeasiblePlan):
            plan_with_replicas(costs, topology, replicas, memory=memory)
        return
    plan = plan_with_replicas(costs, topology, replicas, memory=memory)
    assert [s.replicas for s in plan.stages] == list(replicas)
    assert plan.bottleneck == pytest.approx(best, rel=1e-12)
    assert bottleneck_time(plan.stages, costs, flat, memory=memory) == pytest.approx(best, rel=1e-12)


def test_replica_devices_put_each_replica_of_a_server_stage_in_its_own_server() -> None:
    """Two servers of two devices, a device holding one layer: a level-2 stage replicated on both
    servers runs its inner pipeline in each, so each inner stage has one device per server."""
    costs = LayerCosts(compute=[10, 10], activation_bytes=[1, 0], param_bytes=[0, 0], resident_bytes=[10, 10])
    topology = Topology.hierarchical([(2, 100.0), (2, 1.0)])
    plan = plan_pipeline(costs, topology, memory=15)
    assert plan.stages == (StageSpan(0, 1, 2, (StageSpan(0, 0, 1), StageSpan(1, 1, 1))),)
    assert plan.replica_devices() == [(0, 0, (0, 2)), (1, 1, (1, 3))]
    assert plan.device_stages() == [(0, 0, 2), (1, 1, 2)]
    with pytest.raises(ValueError, match="replicated"):
        plan.placed_stages()


def test_ranks_grouped_by_host_give_the_topology_its_levels() -> None:
    """torchrun numbers ranks host by host: hosts a, a, b, b are 2 servers of 2 (PipeDream Fig. 2.6),
    and the DP plans over both levels; ranks interleaved across hosts keep only the matrix."""
    local = Topology.uniform(4, 100.0)
    assert host_levels(["a", "a", "b", "b"]) == (2, 2) and host_levels(["a", "b", "a", "b"]) is None
    assert host_levels(["a"] * 3) == (3, 1)
    grouped = hosts_topology(["a", "a", "b", "b"], local, 1.0)
    assert grouped.levels == (Level(2, 100.0), Level(2, 1.0))
    assert grouped.link(0, 1) == 100.0 and grouped.link(1, 2) == 1.0
    mixed = hosts_topology(["a", "b", "a", "b"], local, 1.0)
    assert mixed.levels == () and mixed.link(0, 2) == 100.0 and mixed.link(0, 1) == 1.0
    # each rank's swaps share its own host's memory link, levels or not
    assert [grouped.host_of(r) for r in range(4)] == [0, 0, 1, 1] and [mixed.host_of(r) for r in range(4)] == [0, 1, 0, 1]
    costs = LayerCosts(compute=[10, 10, 10, 10], activation_bytes=[100, 1, 100, 0], param_bytes=[0] * 4)
    assert len(plan_pipeline(costs, grouped, straight=True).levels) == 2
