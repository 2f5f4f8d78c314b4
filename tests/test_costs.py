"""Cost models: the profiler (Harmony §4.2, Srifty §3), analytic roofline costs, calibration, topology."""

import functools
import itertools
import json
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import stagewise as sw
import stagewise.compiler.compile.costing as costing
from stagewise.compiler.compile.calibrate import (
    Calibration,
    OptimizerCost,
    calibrate,
    handoff_seconds,
    local_topology,
    optimizer_cost,
    relative_speeds,
    send_bandwidth,
)
from stagewise.ir.devices import Device, parse_bandwidth, parse_flops
from stagewise.ir.errors import DeviceError
from stagewise.ir.plan import DeviceSpec, LayerCost
from stagewise.ir.topology import Level, Topology
from stagewise.passes import profile as prof
from stagewise.passes import profile_context as context
from stagewise.passes import profile_sizes
from stagewise.passes.analytic import BACKWARD_OP_RATIO, analytic_layers, dispatches, roofline
from stagewise.passes.capture import trace
from stagewise.passes.contention import costliest_layer, host_contention
from stagewise.passes.layers import build_layers
from stagewise.passes.machine_cache import forget_in_memory, remembered
from stagewise.passes.profile import (
    LayerProfile,
    PiecewiseLinear,
    ProfileError,
    costs_at,
    profile_layers,
    traced_microbatch_size,
)
from stagewise.passes.profile_shapes import shapes_at
from stagewise.passes.profile_sizes import probe_sizes, slow_start
from tests.models.gpt import TinyGPT, lm_loss
from tests.models.mlp import mlp


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    """Every test gets its own profile cache, never the user's."""
    monkeypatch.setenv("STAGEWISE_CACHE", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def mlp_graph():
    torch.manual_seed(0)
    model = mlp(width=16, depth=4)
    traced = trace(model, (torch.randn(8, 8),), torch.randint(0, 5, (8,)), F.cross_entropy)
    return model, traced.graph_module, build_layers(traced.graph_module, model)


@pytest.fixture(scope="module")
def gpt_graph():
    torch.manual_seed(0)
    model = TinyGPT(layers=4)
    x = torch.randint(0, 64, (4, 16))
    traced = trace(model, (x,), torch.randint(0, 64, (4, 16)), lm_loss)
    return model, traced.graph_module, build_layers(traced.graph_module, model)


def count_measurements(monkeypatch) -> list:
    calls = []
    real = prof.measure_layer

    def counting(module, inputs, device, repeats=1):
        calls.append(module)
        return real(module, inputs, device, repeats)

    monkeypatch.setattr(prof, "measure_layer", counting)
    return calls


def fake_output_bytes(gm, layer) -> int:
    values = {n.name: n.meta["val"] for n in gm.graph.nodes}
    return sum(values[v].numel() * values[v].element_size() for v in layer.outputs)


# ---- profiler -------------------------------------------------------------------------------------------
def test_profile_mlp_times_bytes_and_state(mlp_graph):
    model, gm, layers = mlp_graph
    profiles = profile_layers(gm, layers, "cpu", quiet=True, repeats=1)
    assert [p.layer for p in profiles] == [layer.index for layer in layers]
    assert [c.u for c in profiles[0].probes] == [1, 2, 4, 8]  # 1..traced size, geometric
    for layer, p in zip(layers, profiles, strict=True):
        cost = p.cost(8)
        assert cost.fwd_s > 0 and cost.recompute_s > 0 and cost.bwd_s > 0
        assert cost.act_bytes == fake_output_bytes(gm, layer)
        expected = sum(gm.get_parameter(name).numel() * 4 for name in layer.params)
        assert cost.param_bytes == cost.grad_bytes == expected
        assert cost.optim_bytes == 2 * expected  # AdamW: two moments
    # what autograd saves: Linear(8, 16) its input (8 floats a sample), Tanh its output (16 floats)
    assert [c.stash_bytes for c in profiles[0].probes] == [32 * u for u in (1, 2, 4, 8)]
    assert [c.stash_bytes for c in profiles[1].probes] == [64 * u for u in (1, 2, 4, 8)]


def test_measured_stash_equals_fake_estimate(mlp_graph, gpt_graph):
    for _, gm, layers in (mlp_graph, gpt_graph):
        traced = prof.traced_microbatch_size(gm)
        fake = shapes_at(gm, layers, traced, traced)
        profiles = profile_layers(gm, layers, "cpu", [traced], quiet=True, repeats=1)
        assert [p.cost(traced).stash_bytes for p in profiles] == fake.stash_bytes


def test_identical_blocks_are_profiled_once(gpt_graph, monkeypatch):
    _, gm, layers = gpt_graph
    calls = count_measurements(monkeypatch)
    profiles = profile_layers(gm, layers, "cpu", quiet=True, repeats=1)
    blocks = [p for p in profiles if p.name.startswith("blocks.")]
    assert len({p.signature for p in blocks[1:]}) == 1  # blocks.0 also holds the embedding sum
    n_unique = len({p.signature for p in profiles})
    n_probes = len(profiles[0].probes)
    assert n_unique == len(layers) - 2 and len(calls) == n_unique * n_probes
    assert blocks[2].probes[0] == LayerCost(**{**blocks[1].probes[0].__dict__, "layer": blocks[2].layer})
    for layer, p in zip(layers, profiles, strict=True):
        assert p.cost(4).act_bytes == fake_output_bytes(gm, layer)
        assert p.param_bytes == sum(gm.get_parameter(name).numel() * 4 for name in layer.params)


def test_profiling_leaves_the_model_alone(gpt_graph):
    model, gm, layers = gpt_graph
    before = {k: v.clone() for k, v in model.state_dict().items()}
    profile_layers(gm, layers, "cpu", quiet=True, repeats=1)
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_profiling_keeps_buffers_and_the_random_stream():
    """BatchNorm updates its buffers and dropout draws random numbers; neither may leak out."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8), torch.nn.Dropout(0.5),
                                torch.nn.Linear(8, 5))
    traced = trace(model, (torch.randn(8, 8),), torch.randint(0, 5, (8,)), F.cross_entropy)
    layers = build_layers(traced.graph_module, model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    profile_layers(traced.graph_module, layers, Device("cpu", memory="1MiB"), quiet=True, repeats=1)
    assert torch.equal(rng, torch.get_rng_state())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_second_call_hits_the_disk_cache(mlp_graph, monkeypatch, tmp_path):
    _, gm, layers = mlp_graph
    monkeypatch.setattr(prof, "STALE_RATIO", math.inf)  # microsecond layers: the spot check's noise is not tested here
    calls = count_measurements(monkeypatch)
    first = profile_layers(gm, layers, "cpu", quiet=True, repeats=1)
    assert calls and list((tmp_path / "cache" / "profiles").glob("*.json"))
    calls.clear()
    second = profile_layers(gm, layers, "cpu", quiet=True, repeats=1)
    assert len(calls) == 1  # only the spot check of the costliest layer
    assert second == first
    calls.clear()
    profile_layers(gm, layers, "cpu", [2, 4], quiet=True, repeats=1)  # another request: measured again
    assert len(calls) > 1


def test_a_cache_hit_runs_the_graph_on_fake_tensors_once(gpt_graph, monkeypatch):
    """The spot check of a cache hit times the costliest layer on inputs at the traced size: one fake
    run of the whole graph gives all of them (it was one run per input of that layer)."""
    _, gm, layers = gpt_graph
    monkeypatch.setattr(prof, "STALE_RATIO", math.inf)  # read back, not profiled again
    profile_layers(gm, layers, "cpu", quiet=True, repeats=1)  # writes the cache entry
    runs = []
    monkeypatch.setattr(prof, "shapes_at", lambda *args, **kwargs: runs.append(args) or shapes_at(*args, **kwargs))
    profile_layers(gm, layers, "cpu", quiet=True, repeats=1)
    assert len(runs) == 1  # the costliest layer here, the head and loss, has two inputs: two runs on b87c994


def test_a_cache_entry_timed_under_load_is_measured_again(mlp_graph, monkeypatch, tmp_path):
    """Times 20x what the layers take now (as when other jobs loaded the machine) are not trusted."""
    _, gm, layers = mlp_graph
    profile_layers(gm, layers, "cpu", quiet=True, repeats=1)  # writes the cache entry
    (path,) = (tmp_path / "cache" / "profiles").glob("*.json")
    data = json.loads(path.read_text())
    for profile in data["profiles"]:
        for key in ("fwd_s", "bwd_s", "recompute_s"):
            profile[key]["ys"] = [20 * y for y in profile[key]["ys"]]
    path.write_text(json.dumps(data))
    inflated = [LayerProfile.from_dict(profile) for profile in data["profiles"]]
    calls = count_measurements(monkeypatch)
    again = profile_layers(gm, layers, "cpu", quiet=True, repeats=1)
    assert len(calls) > 1  # profiled again, not read back
    # not the inflated entry: a read-back equals it exactly (as a cache hit equals the first profile); a
    # comparison with the first profile's seconds would depend on the load on the machine now
    assert all(a.fwd_s != b.fwd_s for a, b in zip(again, inflated, strict=True))


def test_layer_profile_round_trips_through_json(mlp_graph):
    _, gm, layers = mlp_graph
    profiles = profile_layers(gm, layers, "cpu", quiet=True, repeats=1, cache=False)
    text = json.dumps([p.to_dict() for p in profiles])
    assert [LayerProfile.from_dict(d) for d in json.loads(text)] == profiles


def test_profiled_costs_are_exact_at_probes_and_monotone(mlp_graph):
    _, gm, layers = mlp_graph
    profiles = profile_layers(gm, layers, "cpu", quiet=True, repeats=1)
    for p in profiles:
        for probe in p.probes:  # bytes are exact at every probe (times may be smoothed, see below)
            cost = p.cost(probe.u)
            assert (cost.act_bytes, cost.stash_bytes) == (probe.act_bytes, probe.stash_bytes)
        for key in ("fwd_s", "bwd_s", "recompute_s", "act_bytes", "stash_bytes", "workspace_bytes"):
            values = [getattr(p.cost(u), key) for u in range(1, 20)]
            assert values == sorted(values), key


def test_layers_are_timed_in_context(gpt_graph, monkeypatch):
    """PipeDream §2.4.1 times layers inside whole iterations: every layer's forward and backward are
    timed back to back with the others (each backward fed its consumers' gradients), their ratios to
    the probes scale the profile, identical layers share one factor, and a ratio outside
    CONTEXT_RANGE (a disturbed measurement) is not used."""
    _, gm, layers = gpt_graph
    raw = [p.in_context(1 / p.context_fwd, 1 / p.context_bwd)
           for p in profile_layers(gm, layers, "cpu", quiet=True, repeats=1, cache=False)]
    shapes, cpu = shapes_at(gm, layers, 4, 4), prof.resolve_devices("cpu")[0]
    names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    inputs = dict(zip(names, prof.real_inputs([shapes.values[n] for n in names], torch.device("cpu")), strict=True))
    outputs = {n.name for n in gm.graph.output_node().all_input_nodes}
    times = context._layers_back_to_back(layers, [prof.layer_module(gm, layer) for layer in layers], inputs, outputs,
                                         torch.device("cpu"))
    assert all(fwd > 0 for fwd, _ in times)
    assert all(bwd > 0 for (_, bwd), layer in zip(times, layers, strict=True) if layer.params)  # gradients reached every layer

    def timed(fn, device):  # every forward "takes" 2 s, every backward 3 s
        return (3.0 if isinstance(fn, functools.partial) else 2.0), fn()

    monkeypatch.setattr(context, "timed", timed)
    assert context.in_context_factors(gm, layers, raw, shapes, cpu, repeats=1) == [(1.0, 1.0)] * len(layers)
    monkeypatch.setattr(context, "CONTEXT_RANGE", (0.0, math.inf))
    factors = context.in_context_factors(gm, layers, raw, shapes, cpu, repeats=1)
    by_name = dict(zip((p.name for p in raw), factors, strict=True))
    for p in raw:
        if p.name not in ("blocks.2", "blocks.3"):  # they share blocks.1's signature; its probe is theirs
            assert by_name[p.name] == pytest.approx((2.0 / p.fwd_s(4), 3.0 / p.bwd_s(4)))
    assert by_name["blocks.1"] == by_name["blocks.2"] == by_name["blocks.3"]


def test_in_context_scales_times_only(mlp_graph):
    _, gm, layers = mlp_graph
    (p, *_) = profile_layers(gm, layers, "cpu", quiet=True, repeats=1, cache=False)
    q = p.in_context(2.0, 3.0)
    assert (q.context_fwd, q.context_bwd) == pytest.approx((2 * p.context_fwd, 3 * p.context_bwd))
    for u in (1, 3, 8):
        a, b = p.cost(u), q.cost(u)
        assert (b.fwd_s, b.recompute_s, b.bwd_s) == pytest.approx((2 * a.fwd_s, 2 * a.recompute_s, 3 * a.bwd_s))
        assert (b.act_bytes, b.stash_bytes, b.param_bytes) == (a.act_bytes, a.stash_bytes, a.param_bytes)
    assert [c.bwd_s for c in q.probes] == pytest.approx([3 * c.bwd_s for c in p.probes])
    assert LayerProfile.from_dict(json.loads(json.dumps(q.to_dict()))) == q


def test_piecewise_linear_fit():
    f = PiecewiseLinear.fit([1, 2, 4, 8], [1.0, 1.5, 2.5, 6.5])
    assert [f(x) for x in (1, 2, 4, 8)] == [1.0, 1.5, 2.5, 6.5]
    assert f(3) == 2.0 and f(6) == 4.5  # linear between probes
    assert f(16) == 6.5 + 8 * 1.0  # past the last probe: the last segment's slope
    noisy = PiecewiseLinear.fit([4, 1, 2], [3.0, 2.0, 1.0])  # a dip at u=2 is noise
    assert noisy.xs == (1.0, 2.0, 4.0) and noisy.ys == (2.0, 2.0, 3.0)
    values = [noisy(x / 4) for x in range(0, 40)]
    assert values == sorted(values)
    assert PiecewiseLinear.fit([4], [8.0])(2) == 4.0  # one probe: proportional


def test_probe_sizes_span_one_to_max():
    assert probe_sizes(1) == (1,)
    assert probe_sizes(8) == (1, 2, 4, 8)
    sizes = probe_sizes(100)
    assert sizes[0] == 1 and sizes[-1] == 100 and len(sizes) == 4


# ---- slow start (Harmony §4.2) --------------------------------------------------------------------------
@pytest.mark.parametrize("capacity", [999, 1000, 1036, 1037, 1100, 1500, 3000, 4000, 40_000, 123_456])
def test_slow_start_finds_the_largest_fitting_size(capacity):
    probed = []

    def fits(u: int) -> bool:
        probed.append(u)
        return 1000 + 37 * u <= capacity  # synthetic memory: state + activations per sample

    expected = max(0, (capacity - 1000) // 37)
    assert slow_start(fits, limit=10_000) == expected
    assert len(probed) <= 2 * math.log2(max(expected, 2)) + 3  # multiplicative then halving steps


def test_slow_start_stops_at_the_limit():
    assert slow_start(lambda u: True, limit=100) == 100
    assert slow_start(lambda u: u <= 64, limit=100) == 64


def test_capacity_bounds_the_microbatch(mlp_graph):
    _, gm, layers = mlp_graph
    state = [prof.layer_state_bytes(gm, layer, 2.0) for layer in layers]
    capacity = 5000
    profiles = profile_layers(gm, layers, Device("cpu", memory=capacity), quiet=True, repeats=1)
    largest = profiles[0].max_microbatch
    assert largest is not None and all(p.max_microbatch == largest for p in profiles)
    assert profile_sizes.fits(shapes_at(gm, layers, largest, 8), state, capacity)
    assert not profile_sizes.fits(shapes_at(gm, layers, largest + 1, 8), state, capacity)
    assert max(c.u for c in profiles[0].probes) == largest


def test_too_little_memory_for_one_sample_is_a_clear_error(mlp_graph):
    _, gm, layers = mlp_graph
    with pytest.raises(ProfileError, match="microbatch size 1"):
        profile_layers(gm, layers, "cpu", capacity=100, quiet=True, repeats=1)


# ---- analytic -------------------------------------------------------------------------------------------
def test_analytic_costs_scale_linearly_and_with_peak_flops(gpt_graph):
    _, gm, layers = gpt_graph
    fast = Device("cpu", peak_flops="2GFLOPS", memory_bandwidth=1e15)
    slow = Device("cpu", peak_flops="1GFLOPS", memory_bandwidth=1e15)
    roofline_only = {"op_dispatch_s": 0.0}  # the roofline alone; the ops' dispatch: the test below
    for p_fast, p_slow, layer in zip(analytic_layers(gm, layers, 4, fast, **roofline_only),
                                     analytic_layers(gm, layers, 4, slow, **roofline_only), layers, strict=True):
        a, b = p_fast.cost(4), p_fast.cost(8)
        assert b.act_bytes == 2 * a.act_bytes and b.stash_bytes == 2 * a.stash_bytes
        assert a.act_bytes == fake_output_bytes(gm, layer)
        if layer.flops:  # compute-bound: time linear in u, inversely proportional to peak FLOP/s
            assert b.fwd_s == pytest.approx(2 * a.fwd_s, rel=1e-6)
            assert a.fwd_s == pytest.approx(layer.flops / 2e9, rel=1e-6)
            assert p_slow.cost(4).fwd_s == pytest.approx(2 * a.fwd_s, rel=1e-6)
            assert a.bwd_s == pytest.approx(2 * a.fwd_s) and a.recompute_s == a.fwd_s
        assert a.param_bytes == p_slow.cost(4).param_bytes == layer.param_bytes


def test_roofline_is_memory_bound_below_the_knee():
    f = roofline(flops_per_u=100.0, bytes_per_u=10.0, fixed_bytes=1000.0, peak=10.0, bandwidth=10.0)
    # a = 10 s per sample, b = 1 s per sample, c = 100 s: knee at 100 / 9 samples
    assert f(1) == pytest.approx(101.0) and f(5) == pytest.approx(105.0)
    assert f(20) == pytest.approx(200.0) and f(40) == pytest.approx(400.0)
    assert roofline(1.0, 10.0, 0.0, 1.0, 1.0)(3) == pytest.approx(30.0)  # always memory-bound


def test_analytic_uses_a_device_spec_and_defaults(mlp_graph):
    _, gm, layers = mlp_graph
    spec = DeviceSpec("cuda:0", "cuda", memory=None, speed=1.0, peak_flops=1e12, memory_bandwidth=1e15)
    assert analytic_layers(gm, layers, 8, spec, op_dispatch_s=0.0)[0].cost(8).fwd_s == pytest.approx(layers[0].flops / 1e12)
    assert analytic_layers(gm, layers, 8, Device("cpu"))[0].cost(8).fwd_s > 0


def test_each_op_costs_its_dispatch_added_on_a_cpu_and_overlapped_on_cuda(mlp_graph):
    """A CPU runs an op's kernel on the thread that dispatched it: the layer takes its roofline plus
    OP_DISPATCH_S per op (BACKWARD_OP_RATIO times that backward). A CUDA device computes while the host
    dispatches: the larger of the two, so a big layer's time is its roofline and a tiny one's its dispatch."""
    _, gm, layers = mlp_graph
    ops = sum(1 for n in gm.graph.nodes if n.name in layers[0].nodes and dispatches(n))
    assert ops > 0
    cpu = Device("cpu", peak_flops=1e9, memory_bandwidth=1e15)
    plain, dispatched = (analytic_layers(gm, layers, 8, cpu, op_dispatch_s=s)[0].cost(8) for s in (0.0, 1e-3))
    assert dispatched.fwd_s == pytest.approx(plain.fwd_s + ops * 1e-3)
    assert dispatched.bwd_s == pytest.approx(plain.bwd_s + BACKWARD_OP_RATIO * ops * 1e-3)
    for peak, bound in ((1e3, "kernels"), (1e15, "dispatch")):  # far slower, then far faster than dispatch
        spec = DeviceSpec("cuda:0", "cuda", memory=None, speed=1.0, peak_flops=peak, memory_bandwidth=1e15)
        kernels, both = (analytic_layers(gm, layers, 8, spec, op_dispatch_s=s)[0].cost(8) for s in (0.0, 1e-3))
        want = kernels.fwd_s if bound == "kernels" else ops * 1e-3
        assert both.fwd_s == pytest.approx(want) and both.fwd_s == pytest.approx(max(kernels.fwd_s, ops * 1e-3))


class _PythonOperators(nn.Module):
    """Tensor ops a torch.fx trace writes as Python operators, beside operators on sizes and tuples."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 8))

    def forward(self, x):
        first, _ = x.split(4, dim=1)  # getitem of split's tuple: no op
        half = x.shape[1] // 2  # getattr, getitem and floordiv on sizes: no op
        return ((x @ self.w + x)[:, :half] * first).sum()


def test_python_operators_on_tensors_are_charged_their_dispatch():
    """operator.matmul / add / getitem / mul on tensors run an op each (their dispatch was missed:
    an fx-traced residual add or weight slice cost nothing); on sizes and tuples they run none."""
    traced = trace(_PythonOperators(), (torch.randn(2, 8),), None, None)
    assert traced.tracer == "fx"
    charged = {n.name for n in traced.graph_module.graph.nodes if dispatches(n)}
    assert charged == {"split", "matmul", "add", "getitem_6", "mul", "sum_2"}


# ---- devices, calibration, topology ---------------------------------------------------------------------
def test_device_rates_parse_and_reach_the_spec():
    d = Device("cpu", memory="1GiB", peak_flops="100TFLOPS", memory_bandwidth="900GB/s", host_bandwidth="16GiB/s")
    assert (d.peak_flops, d.memory_bandwidth, d.host_bandwidth) == (1e14, 9e11, 16 * 2**30)
    spec = d.spec()
    assert (spec.peak_flops, spec.memory_bandwidth, spec.host_bandwidth) == (1e14, 9e11, 16 * 2**30)
    assert Device("cpu") == Device("cpu") and Device("cpu").spec().peak_flops is None
    assert parse_flops(5e10) == 5e10 and parse_bandwidth("2TB/s") == 2e12
    with pytest.raises(DeviceError, match="peak_flops"):
        Device("cpu", peak_flops="fast")
    with pytest.raises(DeviceError, match="positive"):
        Device("cpu", memory_bandwidth=0)


def test_calibration_returns_positive_numbers():
    cal = calibrate("cpu")
    assert cal.kind == "cpu" and cal.copy_bandwidth > 0 and cal.host_bandwidth > 0 and cal.matmul_flops > 0
    assert calibrate(Device("cpu")) is cal  # cached in memory
    assert send_bandwidth("cpu", "cpu") > 0
    assert relative_speeds(["cpu", "cpu"]) == [1.0, 1.0]
    topology = local_topology(2)
    assert topology.n_devices == 2 and topology.link(0, 1) > 0


def test_runtime_calibration_optimizer_handoff_and_contention(gpt_graph):
    """What the simulator charges beyond the layers: each is measured, positive and bounded."""
    sgd = optimizer_cost(functools.partial(torch.optim.SGD, lr=0.1))
    assert sgd.per_tensor_s > 0 and sgd.per_byte_s >= 0
    assert sgd.seconds(10, 4_000_000) > sgd.seconds(1, 4_000) > 0
    assert 0 < handoff_seconds() < 0.05
    _, gm, layers = gpt_graph
    costs = costs_at(profile_layers(gm, layers, "cpu", quiet=True, repeats=1, cache=False), 2)
    assert costliest_layer(gm, layers, costs).name.startswith("blocks.")  # the repeated blocks dominate
    measured = host_contention(gm, layers, costs, traced_microbatch_size(gm), threads=3)
    speeds = measured.speeds
    assert len(speeds) == 3 and speeds[0] == 1.0 and measured.wake_s >= 0
    assert all(0 < b <= a for a, b in itertools.pairwise(speeds))


def test_each_update_is_charged_the_undo_record_the_runtime_copies_before_it(monkeypatch):
    """Before a stage's optimizer step the runtime copies its weights and optimizer state to host
    memory (runtime/undo.py), every step: the update is charged that copy at the host link's
    bandwidth (with a link of 1 MB/s, each layer's update takes at least its bytes / 1e6 seconds;
    uncharged before, microseconds)."""
    slow_link = Calibration(device="cpu", kind="cpu", copy_bandwidth=1e6, host_bandwidth=1e6, matmul_flops=1e10)
    monkeypatch.setattr(costing, "calibrate", lambda device: slow_link)
    torch.manual_seed(0)
    adam = functools.partial(torch.optim.Adam, lr=1e-3)  # two moments: 3 copies of each weight
    x, y = torch.randn(8, 8), torch.randint(0, 5, (8,))
    model = mlp()
    pipe = sw.compile(model, 1, (x,), loss_fn=F.cross_entropy, example_target=y, optimizer=adam,
                      microbatches=1, cost="analytic")
    for layer, update_s in zip(pipe.plan.layers, pipe.plan.costs.runtime.update_s, strict=True):
        state_bytes = 3 * sum(model.get_parameter(name).numel() * 4 for name in layer.params)
        assert state_bytes > 0 or not layer.params
        assert update_s >= state_bytes / 1e6


def test_this_machines_figures_are_measured_once_and_read_back_by_later_processes(tmp_path, monkeypatch):
    """What compile measures about the machine beside the layers is kept on disk: a later process
    (forget_in_memory) reads the same figures instead of measuring them again under another load;
    another key is measured; an unreadable entry is measured again."""
    monkeypatch.setenv("STAGEWISE_CACHE", str(tmp_path))
    measured = []

    def measure() -> OptimizerCost:
        measured.append(1)
        return OptimizerCost(per_tensor_s=1e-5 * len(measured), per_byte_s=2e-9)

    first = remembered("test", ("sgd", "cpu"), measure, OptimizerCost)
    forget_in_memory()
    assert remembered("test", ("sgd", "cpu"), measure, OptimizerCost) == first and len(measured) == 1
    assert remembered("test", ("adam", "cpu"), measure, OptimizerCost) != first and len(measured) == 2
    assert remembered("seconds", 1, lambda: 3e-5, float) == 3e-5
    for entry in (tmp_path / "machine").glob("test-*.json"):
        entry.write_text("{not json")
    forget_in_memory()
    assert remembered("test", ("sgd", "cpu"), measure, OptimizerCost) != first and len(measured) == 3  # measured again
    forget_in_memory()
    handoff = handoff_seconds()
    forget_in_memory()
    assert handoff_seconds() == handoff  # the real figure, read back


def test_two_level_topology_is_fast_within_and_slow_across_servers():
    t = Topology.two_level(servers=2, per_server=4, intra="100GB/s", inter="10GB/s")
    assert t.n_devices == 8
    assert t.link(0, 3) == t.link(4, 7) == 1e11
    assert t.link(0, 4) == t.link(7, 0) == 1e10
    assert t.link(2, 2) == math.inf
    assert [t.group(d, 1) for d in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert (t.level_between(1, 2), t.level_between(1, 6)) == (1, 2)
    assert len(t.links()) == 8 * 7
    assert Topology.from_json(t.to_json()) == t
    assert json.loads(t.to_json())["bandwidth"][0][0] is None  # JSON has no infinity


def test_uniform_topology_and_bad_matrices():
    t = Topology.uniform(3, 5e9)
    assert {t.link(i, j) for i in range(3) for j in range(3) if i != j} == {5e9}
    assert Topology.from_matrix([[None, 1], [2, None]]).link(1, 0) == 2
    with pytest.raises(DeviceError):
        Topology.from_matrix([[None, 1], [0, None]])
    with pytest.raises(DeviceError):
        Topology(((math.inf, 1.0),))


def test_a_topology_among_some_devices_keeps_their_links_and_whole_levels():
    t = Topology.two_level(servers=2, per_server=4, intra="100GB/s", inter="10GB/s")
    assert t.among(range(4)).levels == t.levels[:1] and t.among(range(8)) == t
    assert t.among([3, 4]).links() == {(0, 1): 1e10, (1, 0): 1e10} and t.among([3, 4]).levels == ()
    assert t.among(range(6)).hierarchy() == (Level(6, 1e10),)  # no whole groups: one level, the slowest link
    assert Topology.uniform(1, 1e9).slowest_link == math.inf
    with pytest.raises(DeviceError, match="distinct"):
        t.among([0, 0])


def test_export_graphs_are_profiled_at_several_sizes(monkeypatch):
    """A torch.export graph runs at its traced size only; the capture gives the profiler a graph per
    probe size, so fixed per-microbatch costs show (not times proportional to one probe)."""
    from tests.hf import gpt2, lm_batches

    sizes = set()
    real = prof.measure_layer

    def recording(module, inputs, device, repeats=prof.REPEATS):
        sizes.update(t.shape[0] for t in inputs if isinstance(t, torch.Tensor) and t.dim() > 0)
        return real(module, inputs, device, repeats)

    monkeypatch.setattr(prof, "measure_layer", recording)
    inputs, _ = lm_batches(1)[0]
    pipe = sw.compile(gpt2(layers=2), 2, inputs, schedule="gpipe")  # microbatches=None: the planner weighs sizes
    assert pipe.plan.tracer == "export"
    assert len(sizes) > 2  # probes at several sizes, not only the traced one (4)
