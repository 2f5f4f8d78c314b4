"""The planning algorithms against brute force and against the papers' own examples.

PipeDream's DP (dissertation §2.4.1), the CP-SAT bindings and Harmony's packing (Alg. 1, 2 and
the Appendix A reduction) work on plain per-layer numbers, so small instances can be solved by
enumeration here, with the cost model written out again independently of the passes.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import pytest

from stagewise.ir.topology import Topology
from stagewise.passes.cpsat import Block, bind_blocks, partition_and_bind
from stagewise.passes.harmony_packing import (
    BACKWARD,
    FORWARD,
    Configuration,
    balanced_time_packing,
    split_balanced,
)
from stagewise.passes.pipedream_dp import (
    LayerCosts,
    NoFeasiblePlan,
    PipelinePlan,
    StageSpan,
    plan_pipeline,
)
from tests.harmony_oracle import (
    FunctionCosts,
    TableCosts,
    contiguous_packings,
    estimate_iteration_time,
    optimal_packing,
    round_robin_makespan,
    search_four_tuple,
    simulate_tasks,
)
from tests.pipedream_oracle import bottleneck_time

# --------------------------------------------------------------------------- brute force: DP


def splits(first: int, last: int, cut_allowed: Sequence[bool] | None) -> Iterator[list[tuple[int, int]]]:
    """Every split of first..last into contiguous ranges, cutting only where allowed."""
    gaps = [g for g in range(first, last) if cut_allowed is None or cut_allowed[g]]
    for k in range(len(gaps) + 1):
        for chosen in itertools.combinations(gaps, k):
            ends = [*chosen, last]
            yield [(a, b) for a, b in zip([first] + [c + 1 for c in chosen], ends, strict=True)]


def brute_pipelines(first: int, last: int, k: int, costs: LayerCosts, topo: Topology) -> Iterator[list[StageSpan]]:
    """Every level-k plan of first..last on at most m_k workers, inner plans included."""
    workers = topo.levels[k - 1].workers
    for ranges in splits(first, last, costs.cut_allowed):
        for reps in itertools.product(range(1, workers + 1), repeat=len(ranges)):
            if sum(reps) > workers:
                continue
            if k == 1:
                yield [StageSpan(a, b, r) for (a, b), r in zip(ranges, reps, strict=True)]
                continue
            inners = [list(brute_pipelines(a, b, k - 1, costs, topo)) for a, b in ranges]
            for choice in itertools.product(*inners):
                yield [StageSpan(a, b, r, tuple(inner))
                       for (a, b), r, inner in zip(ranges, reps, choice, strict=True)]


def brute_time(stages: Sequence[StageSpan], k: int, costs: LayerCosts, topo: Topology, memory: float | None) -> float:
    """PipeDream's model written out directly: slowest stage or cut, INF if a device overflows."""
    bandwidth = topo.levels[k - 1].bandwidth
    worst = 0.0
    for index, st in enumerate(stages):
        layers = range(st.first, st.last + 1)
        r = st.replicas
        weights = sum(costs.param_bytes[i] for i in layers)
        allreduce = 4 * (r - 1) * weights / (r * bandwidth)
        if k == 1:
            following = sum(s.replicas for s in stages[index:])
            need = sum(costs.resident_bytes[i] for i in layers) + math.ceil(following / r) * sum(
                costs.stash_bytes[i] for i in layers)
            if memory is not None and need > memory:
                return math.inf
            compute = sum(costs.compute[i] for i in layers)
        else:
            compute = brute_time(st.inner, k - 1, costs, topo, memory)
        worst = max(worst, compute / r, allreduce)
        if index + 1 < len(stages):
            worst = max(worst, 2 * costs.activation_bytes[st.last] / bandwidth)
    return worst


def brute_best(costs: LayerCosts, topo: Topology, memory: float | None) -> float:
    top = len(topo.levels)
    return min((brute_time(p, top, costs, topo, memory) for p in brute_pipelines(0, costs.n_layers - 1, top, costs, topo)),
               default=math.inf)


def random_costs(rng: random.Random, n: int) -> LayerCosts:
    return LayerCosts(
        compute=[rng.randint(1, 12) for _ in range(n)],
        activation_bytes=[rng.choice([0, 1, 4, 10, 30]) for _ in range(n)],
        param_bytes=[rng.randint(0, 20) for _ in range(n)],
        stash_bytes=[rng.randint(0, 6) for _ in range(n)],
        resident_bytes=[rng.randint(1, 20) for _ in range(n)],
        cut_allowed=[rng.random() < 0.8 for _ in range(n - 1)],
    )


def random_topology(rng: random.Random, costs: LayerCosts, levels: int) -> tuple[Topology, float | None]:
    """A hierarchy of `levels` levels and a device memory (None: unlimited)."""
    shape = [rng.randint(1, 4)] if levels == 1 else [rng.randint(1, 2), rng.randint(1, 3)]
    bandwidths = sorted((rng.choice([1.0, 2.0, 5.0, 10.0]) for _ in shape), reverse=True)
    biggest = max(r + 2 * s for r, s in zip(costs.resident_bytes, costs.stash_bytes, strict=True))
    memory = rng.choice([None, biggest, 2 * biggest, sum(costs.resident_bytes), biggest - 1])
    return Topology.hierarchical(list(zip(shape, bandwidths, strict=True))), memory


def check_dp_against_brute_force(costs: LayerCosts, topo: Topology, memory: float | None) -> None:
    expected = brute_best(costs, topo, memory)
    if expected == math.inf:
        with pytest.raises(NoFeasiblePlan, match="devices of"):
            plan_pipeline(costs, topo, memory=memory)
        return
    plan = plan_pipeline(costs, topo, memory=memory)
    assert plan.bottleneck == pytest.approx(expected, rel=1e-12)
    # the plan it returns really achieves that time under the independent model
    assert brute_time(plan.stages, len(topo.levels), costs, topo, memory) == pytest.approx(expected, rel=1e-12)
    assert bottleneck_time(plan.stages, costs, topo, memory=memory) == pytest.approx(expected, rel=1e-12)
    assert plan.workers <= topo.levels[-1].workers


@pytest.mark.parametrize("seed", range(40))
def test_dp_equals_brute_force_one_level(seed: int) -> None:
    rng = random.Random(seed)
    costs = random_costs(rng, rng.randint(1, 6))
    check_dp_against_brute_force(costs, *random_topology(rng, costs, levels=1))


@pytest.mark.parametrize("seed", range(12))
def test_dp_equals_brute_force_two_levels(seed: int) -> None:
    rng = random.Random(1000 + seed)
    costs = random_costs(rng, rng.randint(2, 5))
    check_dp_against_brute_force(costs, *random_topology(rng, costs, levels=2))


def test_dp_instances_exercise_replication_memory_and_spare_workers() -> None:
    """The random instances above cover what they claim to: replicated stages, memory-bound
    infeasibility, and plans that leave workers idle."""
    replicated = infeasible = spare = 0
    for seed in range(40):
        rng = random.Random(seed)
        costs = random_costs(rng, rng.randint(1, 6))
        topo, memory = random_topology(rng, costs, levels=1)
        try:
            plan = plan_pipeline(costs, topo, memory=memory)
        except NoFeasiblePlan:
            infeasible += 1
            continue
        replicated += any(s.replicas > 1 for s in plan.stages)
        spare += plan.workers < topo.levels[0].workers
    assert replicated >= 5 and infeasible >= 3 and spare >= 3


def test_dp_reproduces_figure_2_7() -> None:
    """Fig. 2.7: stage 1 takes 2+4 units, stage 2 takes 1+2; on 3 workers the first is replicated twice."""
    costs = LayerCosts(compute=[6, 3], activation_bytes=[1, 1], param_bytes=[0, 100])
    plan = plan_pipeline(costs, Topology.uniform(3, bandwidth=10.0))  # 3-way DP would all-reduce 26.7
    assert plan.stages == (StageSpan(0, 0, 2), StageSpan(1, 1, 1))
    assert plan.bottleneck == pytest.approx(3.0)
    assert plan.in_flight == 2  # NOAM = ceil(3 workers / 2 input replicas)


def test_dp_picks_a_single_replicated_stage_when_data_parallelism_wins() -> None:
    """The no-split candidate the printed recurrence omits (pure DP, as for ResNet-50)."""
    costs = LayerCosts(compute=[4, 4, 4, 4], activation_bytes=[1000] * 4, param_bytes=[1] * 4)
    plan = plan_pipeline(costs, Topology.uniform(4, bandwidth=10.0))
    assert plan.stages == (StageSpan(0, 3, 4),)
    assert plan.bottleneck == pytest.approx(4.0)  # 16 / 4; all-reduce 4*3*4/(4*10) = 1.2


def test_dp_uses_fewer_workers_when_more_would_be_slower() -> None:
    """Cutting costs 2*500/10 = 100 and replicating costs an all-reduce of 1000 bytes: one worker
    (time 10) beats every plan on 2..4 workers, which the printed recurrence could not choose."""
    costs = LayerCosts(compute=[5, 5], activation_bytes=[500, 0], param_bytes=[1000, 1000])
    plan = plan_pipeline(costs, Topology.uniform(4, bandwidth=10.0))
    assert plan.workers == 1 and plan.bottleneck == pytest.approx(10.0)


def test_dp_memory_limit_forces_a_split_and_infeasible_raises() -> None:
    costs = LayerCosts(compute=[1, 1, 1, 1], activation_bytes=[0] * 4, param_bytes=[10] * 4)
    plan = plan_pipeline(costs, Topology.uniform(4, bandwidth=1.0), memory=20)
    assert all(s.last - s.first + 1 <= 2 for s in plan.stages)
    with pytest.raises(NoFeasiblePlan):
        plan_pipeline(costs, Topology.uniform(4, bandwidth=1.0), memory=9)


def test_dp_hierarchy_keeps_heavy_cuts_inside_a_server() -> None:
    """Fig. 2.6: a cut with large activations belongs on the fast in-server link B1."""
    costs = LayerCosts(compute=[10, 10, 10, 10], activation_bytes=[100, 1, 100, 0], param_bytes=[0] * 4)
    topo = Topology.hierarchical([(2, 100.0), (2, 1.0)])
    plan = plan_pipeline(costs, topo, straight=True)
    assert [(s.first, s.last) for s in plan.stages] == [(0, 1), (2, 3)]  # crosses servers at the light cut
    assert plan.device_stages() == [(0, 0, 1), (1, 1, 1), (2, 2, 1), (3, 3, 1)]
    assert plan.bottleneck == pytest.approx(10.0)


@pytest.mark.parametrize("seed", range(6))
def test_a_straight_hierarchical_plan_places_each_stage_in_its_server(seed: int) -> None:
    """A level-2 stage runs its inner pipeline on the devices of one server: the placed stages tile
    the layers, take distinct devices, and sit in the server of the stage that holds them."""
    rng = random.Random(300 + seed)
    costs = random_costs(rng, rng.randint(2, 6))
    topo = Topology.hierarchical([(2, 100.0), (rng.randint(1, 3), 1.0)])
    try:
        plan = plan_pipeline(costs, topo, straight=True)
    except NoFeasiblePlan:
        return
    placed = plan.placed_stages()
    assert [(a, b) for a, b, _ in placed] == [(a, b) for a, b, _ in plan.device_stages()]
    assert len({d for _, _, d in placed}) == len(placed)
    for server, stage in enumerate(plan.stages):
        assert all(d // 2 == server for a, _, d in placed if stage.first <= a <= stage.last)


def test_straight_pipeline_never_replicates() -> None:
    costs = LayerCosts(compute=[6, 3], activation_bytes=[1, 1], param_bytes=[0, 0])
    plan = plan_pipeline(costs, Topology.uniform(3, bandwidth=100.0), straight=True)
    assert all(s.replicas == 1 for s in plan.stages) and plan.bottleneck == pytest.approx(6.0)


@pytest.mark.parametrize("seed", range(40))
def test_straight_plan_balances_the_stages_below_its_bottleneck(seed: int) -> None:
    """Among every straight split with the optimal bottleneck and as many stages, the plan's stage
    times have the least sum of squares (brute force)."""
    rng = random.Random(seed)
    costs = random_costs(rng, rng.randint(2, 8))
    topo = Topology.hierarchical([(rng.randint(2, 4), rng.choice([1.0, 5.0, 100.0]))])
    memory = random_topology(rng, costs, 1)[1]
    try:
        plan = plan_pipeline(costs, topo, memory=memory, straight=True)
    except NoFeasiblePlan:
        return
    assert brute_time(plan.stages, 1, costs, topo, memory) == pytest.approx(plan.bottleneck, rel=1e-12)

    def squares(stages) -> float:
        return sum(sum(costs.compute[i] for i in range(st.first, st.last + 1)) ** 2 for st in stages)

    best = min(squares(stages) for ranges in splits(0, costs.n_layers - 1, costs.cut_allowed)
               if len(ranges) == len(plan.stages)
               for stages in [[StageSpan(a, b, 1) for a, b in ranges]]
               if brute_time(stages, 1, costs, topo, memory) <= plan.bottleneck * (1 + 1e-12))
    assert squares(plan.stages) == pytest.approx(best, rel=1e-12)


def test_straight_plan_spreads_the_stages_beside_a_heavy_one() -> None:
    """A head worth 5 blocks is the bottleneck; the 12 blocks before it go 4 + 4 + 4, not 5 + 5 + 2."""
    costs = LayerCosts(compute=[1.0] * 12 + [5.0], activation_bytes=[1.0] * 13, param_bytes=[0.0] * 13)
    plan = plan_pipeline(costs, Topology.uniform(4, bandwidth=100.0), straight=True)
    assert [(s.first, s.last) for s in plan.stages] == [(0, 3), (4, 7), (8, 11), (12, 12)]


def test_bottleneck_time_rejects_plans_that_do_not_tile() -> None:
    costs = LayerCosts(compute=[1, 1, 1], activation_bytes=[0] * 3, param_bytes=[0] * 3,
                       cut_allowed=[True, False])
    with pytest.raises(ValueError):
        bottleneck_time([StageSpan(0, 0, 1), StageSpan(2, 2, 1)], costs, Topology.uniform(2, 1.0))
    with pytest.raises(ValueError):
        bottleneck_time([StageSpan(0, 1, 1), StageSpan(2, 2, 1)], costs, Topology.uniform(2, 1.0))
    assert isinstance(plan_pipeline(costs, Topology.uniform(2, 1.0)), PipelinePlan)


# --------------------------------------------------------------------------- brute force: CP-SAT


@dataclass(frozen=True)
class DeviceModel:
    """What the binder reads of a device."""

    speed: float = 1.0
    memory: float | None = None


class Machine(NamedTuple):
    """Devices and the topology joining them: the binder's two arguments (`*cluster`)."""

    devices: tuple[DeviceModel, ...]
    topology: Topology

    @classmethod
    def uniform(cls, n: int, bandwidth: float, memory: float | None = None) -> Machine:
        return cls(tuple(DeviceModel(1.0, memory) for _ in range(n)), Topology.uniform(n, bandwidth))


def random_cluster(rng: random.Random, n: int, memory_scale: float) -> Machine:
    devices = tuple(DeviceModel(speed=rng.choice([1.0, 1.5, 2.0, 3.0]),
                                memory=rng.choice([None, memory_scale, 2 * memory_scale]))
                    for _ in range(n))
    bandwidth = tuple(tuple(rng.choice([1.0, 2.0, 8.0]) for _ in range(n)) for _ in range(n))
    return Machine(devices, Topology.from_matrix(bandwidth))


def brute_binding(blocks: Sequence[Block], cluster: Machine, one_per_device: bool) -> float:
    n_dev = len(cluster.devices)
    assignments = (itertools.permutations(range(n_dev), len(blocks)) if one_per_device
                   else itertools.product(range(n_dev), repeat=len(blocks)))
    best = math.inf
    for devices in assignments:
        if any(c.memory is not None and b.memory > c.memory
               for b, c in zip(blocks, (cluster.devices[d] for d in devices), strict=True)):
            continue
        load = [0.0] * n_dev
        for b, d in zip(blocks, devices, strict=True):
            load[d] += b.work / cluster.devices[d].speed
        cuts = [0.0 if devices[i] == devices[i + 1] else
                2 * blocks[i].out_bytes / cluster.topology.bandwidth[devices[i]][devices[i + 1]]
                for i in range(len(blocks) - 1)]
        best = min(best, max(load + cuts))
    return best


@pytest.mark.parametrize("one_per_device", [True, False])
@pytest.mark.parametrize("seed", range(8))
def test_bind_blocks_equals_brute_force(seed: int, one_per_device: bool) -> None:
    rng = random.Random(seed)
    n_dev = rng.randint(2, 4)
    blocks = [Block(rng.randint(1, 10), rng.randint(1, 10), rng.choice([0, 2, 6]))
              for _ in range(rng.randint(1, n_dev if one_per_device else 5))]
    cluster = random_cluster(rng, n_dev, memory_scale=5)
    expected = brute_binding(blocks, cluster, one_per_device)
    if expected == math.inf:
        with pytest.raises(NoFeasiblePlan, match="no assignment fits"):
            bind_blocks(blocks, *cluster, one_per_device=one_per_device)
        return
    result = bind_blocks(blocks, *cluster, one_per_device=one_per_device)
    assert result.optimal
    assert result.bottleneck == pytest.approx(expected, rel=1e-5)
    if one_per_device:
        assert len(set(result.devices)) == len(blocks)


def brute_partition(work, act, memory, cluster: Machine, cut_allowed) -> float:
    n_dev, best = len(cluster.devices), math.inf
    for ranges in splits(0, len(work) - 1, cut_allowed):
        if len(ranges) > n_dev:
            continue
        blocks = [Block(sum(work[a:b + 1]), sum(memory[a:b + 1]), act[b]) for a, b in ranges]
        best = min(best, brute_binding(blocks, cluster, one_per_device=True))
    return best


@pytest.mark.parametrize("seed", range(14))
def test_partition_and_bind_equals_brute_force(seed: int) -> None:
    rng = random.Random(seed)
    n, n_dev = rng.randint(1, 6), rng.randint(1, 3)
    work = [rng.randint(1, 9) for _ in range(n)]
    act = [rng.choice([0, 1, 3, 8]) for _ in range(n)]
    memory = [rng.randint(1, 6) for _ in range(n)]
    cut_allowed = [rng.random() < 0.8 for _ in range(n - 1)]
    cluster = random_cluster(rng, n_dev, memory_scale=8)
    expected = brute_partition(work, act, memory, cluster, cut_allowed)
    if expected == math.inf:
        with pytest.raises(NoFeasiblePlan):
            partition_and_bind(work, act, memory, *cluster, cut_allowed=cut_allowed)
        return
    result = partition_and_bind(work, act, memory, *cluster, cut_allowed=cut_allowed)
    assert result.optimal and result.bottleneck == pytest.approx(expected, rel=1e-5)
    stages = result.stages
    assert stages[0].first == 0 and stages[-1].last == n - 1
    assert all(a.last + 1 == b.first and cut_allowed[a.last] for a, b in itertools.pairwise(stages))
    assert len({s.device for s in stages}) == len(stages)


@pytest.mark.parametrize("seed", range(10))
def test_partition_and_bind_agrees_with_straight_dp_on_identical_devices(seed: int) -> None:
    """On identical devices CP-SAT's exact partition and PipeDream's straight DP must agree."""
    rng = random.Random(50 + seed)
    n, n_dev = rng.randint(2, 7), rng.randint(1, 4)
    costs = LayerCosts(compute=[rng.randint(1, 9) for _ in range(n)],
                       activation_bytes=[rng.choice([0, 1, 4]) for _ in range(n)],
                       param_bytes=[rng.randint(1, 6) for _ in range(n)])
    memory = max(costs.param_bytes) + rng.randint(0, 8)
    topo = Topology.uniform(n_dev, bandwidth=2.0)
    cluster = Machine.uniform(n_dev, 2.0, memory=memory)
    try:
        dp = plan_pipeline(costs, topo, memory=memory, straight=True)
    except NoFeasiblePlan:
        with pytest.raises(NoFeasiblePlan):
            partition_and_bind(costs.compute, costs.activation_bytes, costs.param_bytes, *cluster)
        return
    exact = partition_and_bind(costs.compute, costs.activation_bytes, costs.param_bytes, *cluster)
    assert exact.bottleneck == pytest.approx(dp.bottleneck, rel=1e-5)


def test_heterogeneous_binding_puts_the_heavy_stage_on_the_fast_device() -> None:
    cluster = Machine((DeviceModel(1.0), DeviceModel(4.0)), Topology.from_matrix(((1.0, 1.0), (1.0, 1.0))))
    result = bind_blocks([Block(8, 1), Block(2, 1)], *cluster)
    assert result.devices == (1, 0) and result.bottleneck == pytest.approx(2.0)


def test_cpsat_reports_infeasible_memory_clearly() -> None:
    cluster = Machine.uniform(2, 1.0, memory=4)
    with pytest.raises(NoFeasiblePlan, match="memory"):
        partition_and_bind([1, 1, 1], [0, 0, 0], [3, 3, 3], *cluster)
    with pytest.raises(NoFeasiblePlan, match="3 stages need 3 devices"):
        bind_blocks([Block(1, 1)] * 3, *cluster)


# --------------------------------------------------------------------------- Harmony Appendix A


def partition_reduction(a: Sequence[int]) -> tuple[list[int], list[int], int]:
    """Table 2: Partition(a_1..a_n) -> layers (p_j, m_j) with M = 7, G = 2, B = 3; returns 2T."""
    big = 6 * sum(a)  # A = 6 sum a_i
    times, sizes = [8 * big, 8 * big], [6, 6]
    for value in a:
        times += [5 * big, value, 5 * big]
        sizes += [4, 2, 4]
    times += [8 * big, 8 * big]
    sizes += [6, 6]
    twice_target = 3 * sum(times) + times[0] + times[-1]  # T = (B sum p + p_1 + p_{3n+4}) / G
    return times, sizes, twice_target


def has_partition(a: Sequence[int]) -> bool:
    return any(2 * sum(c) == sum(a) for k in range(len(a) + 1) for c in itertools.combinations(a, k))


@pytest.mark.parametrize("a", [(6, 2, 4), (2, 2), (3, 1, 1, 2, 3), (5, 3, 2), (1, 2), (1, 1, 4), (2, 3, 7), (4, 1, 1)])
def test_appendix_a_reduction_reaches_target_iff_partition_exists(a: tuple[int, ...]) -> None:
    times, sizes, twice_target = partition_reduction(a)
    packs, makespan = optimal_packing(times, sizes, capacity=7, gpus=2, microbatches=3)
    assert 2 * makespan >= twice_target  # T is a lower bound
    assert (2 * makespan == twice_target) == has_partition(a)
    if has_partition(a):
        # the optimum has the appendix's shape: big layers alone, every a_i joined to a neighbour
        assert [p for p in packs if len(p) == 1 and p[0] in (0, 1, len(times) - 2, len(times) - 1)] == [
            range(0, 1), range(1, 2), range(len(times) - 2, len(times) - 1), range(len(times) - 1, len(times))]
        value_layers = {3 * i for i in range(1, len(a) + 1)}  # 0-indexed position of layer 3i + 1
        assert all(len(p) == 2 for p in packs if value_layers & set(p))


def test_appendix_a_forward_direction_packing_is_balanced() -> None:
    """(=>): from a partition X, pack {3i, 3i+1} for i in X and {3i+1, 3i+2} otherwise; makespan = T."""
    a, chosen = (6, 2, 4), {1}  # X = {1}: a_1 = 6 = a_2 + a_3; pack {3, 4} runs on GPU 1
    times, _, twice_target = partition_reduction(a)
    packs = [[0], [1]]
    for i in range(1, len(a) + 1):
        base = 3 * i - 1  # 0-indexed position of layer 3i
        packs += [[base, base + 1], [base + 2]] if i in chosen else [[base], [base + 1, base + 2]]
    packs += [[len(times) - 2], [len(times) - 1]]
    assert round_robin_makespan([sum(times[j] for j in p) for p in packs], 2, 3) * 2 == twice_target
    # an unbalanced choice leaves an unforced idle time (Fig. 19c)
    assert packs[6:8] == [[8], [9, 10]]
    packs[6:8] = [[8, 9], [10]]  # move a_3 to GPU 1 as well
    assert round_robin_makespan([sum(times[j] for j in p) for p in packs], 2, 3) * 2 > twice_target


def test_every_feasible_packing_respects_the_lower_bound() -> None:
    times, sizes, twice_target = partition_reduction((1, 1, 4))
    makespans = [round_robin_makespan([sum(times[i] for i in p) for p in packs], 2, 3)
                 for packs in contiguous_packings(sizes, 7)]
    assert len(makespans) == 3 ** 3  # each a_i: with 3i, with 3i+2, or alone
    assert min(makespans) * 2 > twice_target


def test_round_robin_makespan_by_hand() -> None:
    # packs 2, 1, 3 on GPUs 0, 1, 0 with 2 microbatches:
    # GPU0: p0 mb0 [0,2] mb1 [2,4]; GPU1: p1 mb0 [2,3] mb1 [4,5]; GPU0: p2 mb0 [4,7] mb1 [7,10]
    assert round_robin_makespan([2, 1, 3], gpus=2, microbatches=2) == 10


# --------------------------------------------------------------------------- Harmony Alg. 1 and 2


def uniform_costs(n: int, time: float = 1.0, memory: float = 1.0) -> FunctionCosts:
    return FunctionCosts(lambda phase, u, layer: time * u, lambda phase, u, layer: memory * u)


def test_balanced_packing_uses_fewest_packs_that_fit() -> None:
    packs = balanced_time_packing(BACKWARD, 1, uniform_costs(12), capacity=4, n_layers=12)
    assert packs == (range(0, 4), range(4, 8), range(8, 12))
    assert balanced_time_packing(BACKWARD, 1, uniform_costs(12), capacity=100, n_layers=12) == (range(0, 12),)


def test_balanced_packing_adds_packs_until_every_pack_fits() -> None:
    """Time-balanced cuts at S = S_min overflow memory here, so Alg. 2 goes on to larger S."""
    times = [1, 1, 1, 1, 4, 4]
    memory = [1, 1, 1, 1, 3, 3]  # total 10, capacity 5 -> S_min = 2, but {0..3}{4,5} holds 6
    costs = FunctionCosts(lambda ph, u, i: times[i], lambda ph, u, i: memory[i])
    packs = balanced_time_packing(BACKWARD, 1, costs, capacity=5, n_layers=6)
    assert all(sum(memory[i] for i in p) <= 5 for p in packs)
    assert len(packs) == 3 and packs == (range(0, 4), range(4, 5), range(5, 6))


def test_balanced_packing_raises_when_a_layer_cannot_fit() -> None:
    with pytest.raises(NoFeasiblePlan, match="layer 0"):
        balanced_time_packing(FORWARD, 4, uniform_costs(3), capacity=3, n_layers=3)


@pytest.mark.parametrize("seed", range(10))
def test_split_balanced_cuts_near_multiples_of_the_average(seed: int) -> None:
    rng = random.Random(seed)
    times = [rng.uniform(0.1, 5.0) for _ in range(rng.randint(3, 15))]
    count = rng.randint(1, len(times))
    packs = split_balanced(times, count)
    assert len(packs) == count and all(len(p) > 0 for p in packs)
    assert [i for p in packs for i in p] == list(range(len(times)))
    average, running = sum(times) / count, 0.0
    for k, pack in enumerate(packs[:-1], start=1):
        running += sum(times[i] for i in pack)
        assert abs(running - k * average) <= max(times) * (1 + 1e-9) * max(1, count - 1)


def test_forward_packs_stop_before_the_jit_pack() -> None:
    costs = uniform_costs(10)
    backward = balanced_time_packing(BACKWARD, 2, costs, capacity=6, n_layers=10)
    forward = balanced_time_packing(FORWARD, 1, costs, capacity=6, backward_packs=backward)
    assert [i for p in forward for i in p] == list(range(backward[-1].start))
    assert forward and all(sum(1 for _ in p) <= 6 for p in forward)


def test_estimate_matches_hand_computed_schedule() -> None:
    """Two GPUs, minibatch 2, U_F = 2, U_B = 1, packs F:{0}, B:{0},{1} (pack {1} jit-computed)."""
    costs = FunctionCosts(lambda ph, u, i: {FORWARD: 1.0, BACKWARD: 2.0}[ph] * u, lambda ph, u, i: 0.0)
    config = Configuration(2, (range(0, 1),), 1, (range(0, 1), range(1, 2)))
    # GPU0: F{0} samples 0-1 [0,2]; GPU1: jit {1} (1+2 per sample) s0 [2,5] s1 [5,8];
    # GPU0: B{0} recompute+backward s0 [5,8] s1 [8,11]
    assert estimate_iteration_time(config, costs, gpus=2, minibatch=2) == pytest.approx(11.0)
    # Harmony DP: each of 2 GPUs runs 1 sample through everything: 2*1 + 3 + 3 (U_F clipped to 1 sample)
    assert estimate_iteration_time(config, costs, gpus=2, minibatch=2, mode="dp") == pytest.approx(7.0)
    # with 2 samples per GPU the tasks still run back to back on one GPU: 2 + 2*3 + 2*3
    assert estimate_iteration_time(config, costs, gpus=2, minibatch=4, mode="dp") == pytest.approx(14.0)


def test_simulate_tasks_waits_only_for_overlapping_samples() -> None:
    tasks = [[(0, 2, 4.0), (2, 4, 4.0)], [(0, 1, 1.0), (1, 2, 1.0), (2, 3, 1.0), (3, 4, 1.0)]]
    # the second task's first two groups start at 4 (after samples 0-1), the last two at 8
    assert simulate_tasks(tasks, [0, 1], 2) == pytest.approx(10.0)


def efficient_but_hungry_costs(n: int) -> TableCosts:
    """Per-sample time falls with microbatch size; backward needs 3x the forward's memory."""
    sizes = range(1, 9)
    per_sample = {u: 1.0 / math.sqrt(u) for u in sizes}
    times = {FORWARD: {u: [u * per_sample[u]] * n for u in sizes},
             BACKWARD: {u: [2 * u * per_sample[u]] * n for u in sizes}}
    memories = {FORWARD: {u: [1.0 * u] * n for u in sizes}, BACKWARD: {u: [3.0 * u] * n for u in sizes}}
    return TableCosts(times, memories)


def test_configuration_search_beats_equal_forward_and_backward_sizes() -> None:
    """Alg. 1 finds U_F != U_B when the passes differ (Equi-FB is 30% slower in the paper).

    On one GPU the forward runs fastest at the largest microbatch, but the backward's memory
    caps U_B at 4: only separate sizes get both."""
    n, minibatch, capacity = 6, 8, 12.0
    costs = efficient_but_hungry_costs(n)
    result = search_four_tuple(n, minibatch, costs, capacity, gpus=1)
    assert result.config.forward_microbatch > result.config.backward_microbatch

    def time_of(u_f: int, u_b: int) -> float:
        backward = balanced_time_packing(BACKWARD, u_b, costs, capacity, n_layers=n)
        forward = balanced_time_packing(FORWARD, u_f, costs, capacity, backward_packs=backward)
        return estimate_iteration_time(Configuration(u_f, forward, u_b, backward), costs, gpus=1,
                                       minibatch=minibatch)

    equi_fb = min(time_of(u, u) for u in range(1, 5))  # U_B > 4 cannot fit one layer in 12 bytes
    assert result.time < equi_fb
    assert result.time == pytest.approx(min(time_of(f, b) for f in range(1, 9) for b in range(1, 5)))
    assert result.explored == 8 * 4


def test_configuration_search_uses_the_given_estimator_and_limits() -> None:
    seen: list[Configuration] = []

    def estimator(config: Configuration) -> float:
        seen.append(config)
        return -config.forward_microbatch - 10 * config.backward_microbatch

    result = search_four_tuple(4, 16, uniform_costs(4), 100.0, gpus=4, mode="dp",
                                  max_forward_microbatch=8, estimator=estimator)
    assert len(seen) == result.explored == 4 * 4  # Harmony DP: D = 16 / 4 caps both sizes at 4
    assert (result.config.forward_microbatch, result.config.backward_microbatch) == (4, 4)
    with pytest.raises(NoFeasiblePlan):
        search_four_tuple(4, 16, uniform_costs(4), 0.5)
