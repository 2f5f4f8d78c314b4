"""The planner chooses better plans than a person would and says how long they will take."""

from dataclasses import replace

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import stagewise as sw
from stagewise.compiler.compile.calibrate import calibrate, local_topology
from stagewise.ir.instructions import Stream
from stagewise.ir.plan import CrossingValue, Cut, DeviceSpec, Layer, LayerCost
from stagewise.ir.topology import Topology
from stagewise.passes.costs import plan_charges
from stagewise.passes.layout import choose_layout
from stagewise.passes.planner import PLAN_MARGIN, partition
from tests.models.gpt import TinyGPT, lm_loss
from tests.reference import ADAMW, SGD, check_equal_training, pipeline_train, token_batches


def _gpt_batch(vocab=64, batch=8, length=8):
    ids = torch.randint(0, vocab, (batch, length + 1))
    return ids[:, :-1], ids[:, 1:]


def _uniform_split(pipe, stages: int) -> list[str]:
    """What a person writes: the same number of layers per stage."""
    layers = pipe.plan.layers
    every = len(layers) / stages
    return [layers[round(every * s)].name for s in range(1, stages)]


def test_auto_keeps_the_simplest_candidate_within_the_margin_of_the_fastest():
    """The fastest plan that fits, or a simpler one (passes/planner.py's order) within PLAN_MARGIN of it:
    noise below the margin does not change the plan from one compile to the next (issue 10)."""
    x, y = _gpt_batch()
    pipe = sw.compile(TinyGPT(), 2, (x,), loss_fn=lm_loss, example_target=y, cost="analytic")
    assert len(pipe.plan.considered) > 3
    times = [float(line.split()[2]) for line in pipe.plan.considered if "ms/iteration, fits" in line]
    assert min(times) - 0.01 <= pipe.plan.predicted_iteration_s * 1e3 <= min(times) * (1 + PLAN_MARGIN) + 0.01
    (chosen,) = [line for line in pipe.plan.considered if "<- chosen" in line]
    assert float(chosen.split()[2]) == pytest.approx(pipe.plan.predicted_iteration_s * 1e3, abs=0.01)
    assert pipe.plan.schedule in ("gpipe", "1f1b", "interleaved")
    assert "plans considered" in str(pipe.plan) and "predicted (analytic costs)" in str(pipe.plan)


def test_large_vocabulary_head_gets_its_own_share():
    """A 16k-vocabulary head costs more than a block: the DP gives it fewer blocks' company than a
    uniform split does, and predicts a shorter bottleneck stage. On devices slow enough that FLOPs,
    not each op's dispatch, decide a layer's time (per microbatch the head's matmul is 17 MFLOP: 3.4 ms
    at 5 GFLOP/s, over 10x a block's 26 ops at 12 us; at a CPU's default 50 GFLOP/s the two are alike)."""
    x, y = _gpt_batch(vocab=16384)
    model = TinyGPT(vocab=16384, layers=6, tie=False)
    devices = [sw.Device("cpu", peak_flops=5e9)] * 3
    ours = sw.compile(model, devices, (x,), loss_fn=lm_loss, example_target=y, cost="analytic", schedule="gpipe",
                      microbatches=4)
    uniform = sw.compile(model, devices, (x,), loss_fn=lm_loss, example_target=y, cost="analytic",
                         schedule="gpipe", microbatches=4, split_points=_uniform_split(ours, 3))
    assert max(ours.plan.predicted_stage_s) < max(uniform.plan.predicted_stage_s)
    # the same charges for both (FLOPs at one rate, no runtime costs measured per compile): the two
    # compiles' measured runtime costs differ by noise as large as the plans' difference
    assert ours.simulate(peak_flops=1e11).iteration_time < uniform.simulate(peak_flops=1e11).iteration_time
    last = ours.plan.stages[-1]
    assert len(last.layers) < len(uniform.plan.stages[-1].layers)


def test_faster_device_gets_more_work():
    """CP-SAT binds stages to devices that differ in speed: the 3x faster device takes the larger share."""
    model = nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.Tanh()) for _ in range(8)], nn.Linear(64, 5))
    x, y = torch.randn(8, 64), torch.randint(0, 5, (8,))
    devices = [sw.Device("cpu", speed=1.0), sw.Device("cpu", speed=3.0)]
    pipe = sw.compile(model, devices, (x,), loss_fn=F.cross_entropy, example_target=y, cost="analytic",
                      schedule="gpipe", microbatches=2)
    flops = {s.device: sum(pipe.plan.layers[i].flops for i in s.layers) for s in pipe.plan.stages}
    assert flops[1] > 2 * flops[0]


def test_plan_respects_device_memory():
    """With one small device, the DP keeps that device's share within its capacity; training then
    stays under the capacity and equals eager."""
    model = TinyGPT(layers=4)
    # the plan's layers' weights: a tied weight counted in each layer that holds it
    state = sum(4 * p.numel() * p.element_size() for _, p in model.named_parameters(remove_duplicate=False))
    small = int(state * 0.35)
    devices = [sw.Device("cpu"), sw.Device("cpu", memory=small)]
    batches = [(( _gpt_batch()[0],), _gpt_batch()[1]) for _ in range(2)]
    pipe = check_equal_training(model, batches, devices, loss_fn=lm_loss, optimizer=SGD, cost="analytic",
                                schedule="gpipe", microbatches=2, swap="off")
    assert pipe.stats[1]["peak_bytes"] <= small


def test_model_larger_than_the_devices_gets_a_swapping_schedule():
    x, y = _gpt_batch()
    model = TinyGPT(layers=4, dim=64)
    state = 4 * sum(p.numel() * p.element_size() for p in model.parameters())
    devices = [sw.Device("cpu", memory=state // 3) for _ in range(2)]
    pipe = sw.compile(model, devices, (x,), loss_fn=lm_loss, example_target=y, cost="analytic")
    assert pipe.plan.schedule in ("harmony-pp", "harmony-dp")
    assert any(ins.stream is Stream.SWAP_IN for p in pipe.programs for ins in p.instructions)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved", "varuna"])
def test_predicted_peak_memory_is_the_pools_measured_peak(schedule):
    """State, stashes and received buffers, as the pool counts them: within 5% on every device."""
    batches = token_batches(2, batch=8, length=16)
    pipe = sw.compile(TinyGPT(layers=4, dim=64), 2, batches[0][0], loss_fn=lm_loss, example_target=batches[0][1],
                      optimizer=ADAMW, microbatches=4, schedule=schedule, cost="analytic")
    pipeline_train(pipe, batches)
    predicted = pipe.simulate().peak_bytes
    for stats in pipe.stats:
        assert predicted[stats["device"]] == pytest.approx(stats["peak_bytes"], rel=0.05)


def test_replicas_auto_searches_p_by_d_and_keeps_the_fastest():
    """Varuna §4.4: every D dividing the devices and the microbatches is simulated; the fastest fits,
    or a simpler one (fewer stages) within PLAN_MARGIN of it (issue 10: plans stable under noise)."""
    batches = token_batches(2, batch=8)
    pipe = check_equal_training(TinyGPT(layers=4), batches, 4, loss_fn=lm_loss, optimizer=ADAMW,
                                microbatches=4, schedule="1f1b", replicas="auto", cost="analytic")
    tried = {int(line.split("D=")[1].split()[0]) if "D=" in line else 1: line for line in pipe.plan.considered}
    assert set(tried) == {1, 2, 4}
    times = {d: float(line.split("ms/iteration")[0].split()[-1]) for d, line in tried.items()}
    replicas = len({s.replica for s in pipe.plan.stages})
    assert pipe.plan.predicted_iteration_s * 1e3 == pytest.approx(times[replicas], abs=0.01)
    assert times[replicas] <= min(times.values()) * (1 + PLAN_MARGIN) + 0.01
    assert all(times[d] > min(times.values()) * (1 + PLAN_MARGIN) for d in times if d > replicas)  # fewer stages


def test_replicas_must_be_a_positive_int_or_auto():
    x, y = _gpt_batch()
    with pytest.raises(sw.PlanError, match="replicas"):
        sw.compile(TinyGPT(), 2, (x,), loss_fn=lm_loss, example_target=y, replicas=0)


def test_fewer_stages_than_devices_trains_like_eager_and_leaves_devices_idle():
    batches = token_batches(2, batch=8)
    pipe = check_equal_training(TinyGPT(layers=4), batches, 4, loss_fn=lm_loss, optimizer=ADAMW,
                                microbatches=4, schedule="1f1b", stages=2, cost="analytic")
    assert len(pipe.plan.stages) == 2 and {s.device for s in pipe.plan.stages} == {0, 1}
    assert [len(p.instructions) for p in pipe.plan.programs[2:]] == [0, 0]
    assert "idle devices: 2, 3" in str(pipe.plan)


@pytest.mark.parametrize("cores", [4, 2])
def test_stages_auto_simulates_every_depth_and_keeps_one_within_the_margin(cores, monkeypatch):
    """PipeDream §2.4.1: the planner may use fewer workers than it has; in-process CPU devices get
    at most a stage per core that computes at full speed. The depth kept is predicted within
    PLAN_MARGIN of the fastest (a simpler plan wins a near tie: `keep_simplest`)."""
    monkeypatch.setattr("stagewise.compiler.assembly.options.computes_at_full_speed", lambda: float(cores))
    batches = token_batches(2, batch=8)
    pipe = check_equal_training(TinyGPT(layers=4), batches, 4, loss_fn=lm_loss, optimizer=SGD,
                                microbatches=4, schedule="gpipe", stages="auto", cost="analytic")
    tried = {int(line.split("P=")[1].split()[0]): line for line in pipe.plan.considered}
    assert set(tried) == set(range(1, cores + 1))
    times = {p: float(line.split("ms/iteration")[0].split()[-1]) for p, line in tried.items()}
    fastest = min(times.values())
    assert times[len(pipe.plan.stages)] <= fastest * (1 + PLAN_MARGIN) + 0.01  # the printed times are rounded
    assert any("chosen" in line for line in pipe.plan.considered)


@pytest.mark.parametrize(("kwargs", "match"), [
    (dict(stages=0), "stages must be"),
    (dict(stages=3, replicas=2), "stages=3 with replicas=2"),
    (dict(stages=2, schedule="interleaved", microbatches=4), "stages= sets the depth"),
])
def test_bad_stage_counts_are_clear_errors(kwargs, match):
    x, y = _gpt_batch()
    with pytest.raises((sw.PlanError, sw.PartitionError), match=match):
        sw.compile(TinyGPT(), 4, (x,), loss_fn=lm_loss, example_target=y, cost="analytic", **kwargs)


def test_stages_and_replicas_auto_search_p_by_d_below_the_devices(monkeypatch):
    """Both searches at once: every D dividing the devices, every depth up to N / D."""
    monkeypatch.setattr("stagewise.compiler.assembly.options.computes_at_full_speed", lambda: 4.0)
    batches = token_batches(2, batch=8)
    pipe = check_equal_training(TinyGPT(layers=4), batches, 4, loss_fn=lm_loss, optimizer=ADAMW, microbatches=4,
                                schedule="1f1b", stages="auto", replicas="auto", cost="analytic")
    tried = {(int(line.split("D=")[1].split()[0]) if "D=" in line else 1, int(line.split("P=")[1].split()[0]))
             for line in pipe.plan.considered}
    assert tried == {(1, 1), (1, 2), (1, 3), (1, 4), (2, 1), (2, 2), (4, 1)}
    used = {s.device for s in pipe.plan.stages}
    assert used == set(range(len(used)))  # the first P x D devices


def test_a_schedule_that_places_its_own_stages_refuses_stages_and_replicas_in_a_search_too():
    x, y = _gpt_batch()
    for kwargs in (dict(stages=2), dict(replicas=2)):
        with pytest.raises(sw.PartitionError, match="interleaved"):
            sw.compile(TinyGPT(), 2, (x,), loss_fn=lm_loss, example_target=y, cost="analytic", schedule="interleaved",
                       **kwargs)


def _chain(seconds: list[float], activation_bytes: list[float]):
    """Layers in a chain: each computes `seconds` (a third forward, two thirds backward) and sends
    `activation_bytes` per sample to the next across a legal cut; no parameters."""
    n = len(seconds)
    layers = tuple(Layer(i, f"layer{i}", (f"n{i}",), (), (), (), ()) for i in range(n))
    cuts = tuple(Cut(i, (CrossingValue(f"n{i}", activation_bytes[i], True, True),), True) for i in range(n - 1))
    costs = [LayerCost(i, 1, t / 3, 2 * t / 3, t / 3, 0, 0, 0, int(activation_bytes[i]) if i < n - 1 else 0, 0, 0)
             for i, t in enumerate(seconds)]
    return layers, cuts, costs


def _partition(devices: list[DeviceSpec], topology: Topology, seconds, activation_bytes):
    layers, cuts, costs = _chain(seconds, activation_bytes)
    layout = choose_layout("gpipe", len(devices), 1, len(cuts))
    return partition("gpipe", layers, cuts, costs, layout, devices, 1, topology)


def test_the_dp_partitions_over_the_topology_levels():
    """PipeDream's DP plans over the topology's levels (Fig. 2.6): heavy cuts go on the fast links
    inside a server and the light one across servers, so all four devices work; over one level of
    the slow link the DP keeps the heavy cuts inside stages and uses two."""
    devices = [DeviceSpec("cpu", "cpu")] * 4
    seconds, activations = [10.0] * 4, [100.0, 1.0, 100.0]
    servers = Topology.two_level(servers=2, per_server=2, intra=100.0, inter=1.0)
    assert _partition(devices, servers, seconds, activations) == ([0, 1, 2, 3], [0, 1, 2, 3])
    assert _partition(devices, Topology.uniform(4, 1.0), seconds, activations) == ([0, 2], [0, 1])


@pytest.mark.parametrize("fast", [(0, 2), (1, 2)])
def test_cpsat_binds_the_stages_across_the_fast_link(fast):
    """Devices of different speeds are bound by CP-SAT over every pair's link: the two stages take
    the pair joined by the only fast link (every other cut would take 100 times longer)."""
    devices = [DeviceSpec("cpu", "cpu"), DeviceSpec("cpu", "cpu"), DeviceSpec("cpu", "cpu", speed=1.5)]
    matrix = [[None if i == j else (1000.0 if {i, j} == set(fast) else 1.0) for j in range(3)] for i in range(3)]
    starts, stage_devices = _partition(devices, Topology.from_matrix(matrix), [10.0] * 3, [100.0, 100.0])
    assert len(starts) == 2 and set(stage_devices) == set(fast)


def test_compile_measures_the_links_and_the_simulator_charges_them():
    """compile() measures the link between every pair of its devices and each one's host link (what
    swaps cross: a memory copy on a CPU); the plan keeps that topology and the simulator charges
    transfers on its links (slower links: a longer iteration)."""
    x, y = _gpt_batch()
    pipe = sw.compile(TinyGPT(), 2, (x,), loss_fn=lm_loss, example_target=y, cost="analytic", schedule="gpipe",
                      microbatches=2)
    topology = pipe.plan.costs.topology
    assert topology == replace(local_topology(2), host_links=(calibrate("cpu").host_bandwidth,) * 2)
    assert plan_charges(pipe.plan).links == topology.links()
    assert pipe.simulate(bandwidth=1e4).iteration_time > pipe.simulate().iteration_time
