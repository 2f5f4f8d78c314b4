"""The event-driven simulator (passes/simulate.py) and the 1F1B schedule (passes/schedule.py).

The programs are lowered from hand-made stages, so no model is traced; the last test compiles
a small model with schedule="1f1b" and checks that it trains exactly like eager training.
"""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch
import torch.nn.functional as F

from stagewise.ir.errors import PlanError
from stagewise.ir.instructions import (
    AllReduceGradNorm,
    AllReduceShared,
    Carried,
    Forward,
    Recv,
    Send,
    Stream,
)
from stagewise.ir.plan import SharedTensor
from stagewise.ir.program import Program
from stagewise.passes.lower import lower
from stagewise.passes.schedule import one_f_one_b, schedule_tasks
from stagewise.passes.simulate import SimCost, simulate
from tests.harness.stages import chain

ACT = 1000.0  # bytes one stage stashes per microbatch
STATE = 50.0  # bytes of parameters, gradients and optimizer state per stage


def programs(schedule: str, p: int, m: int, shared: tuple[SharedTensor, ...] = ()) -> tuple[Program, ...]:
    stages, transfers = chain(p)
    _, tasks = schedule_tasks(schedule, p, m)
    return lower(stages, transfers, shared, tasks, clip_grad_norm=False)


def uniform(p: int, tf: float = 1.0, tb: float = 2.0, **kwargs) -> SimCost:
    return SimCost.uniform(p, tf, tb, stash_bytes=(ACT,) * p, state_bytes=(STATE,) * p, **kwargs)


# ---- the schedule ------------------------------------------------------------------------------
def test_1f1b_task_order() -> None:
    """Warm-up of p - s - 1 forwards, then alternate F and B, then the remaining backwards."""
    tasks = one_f_one_b(3, 4)
    order = [[f"{t.phase.value}{'' if t.microbatch is None else t.microbatch}" for t in stage] for stage in tasks]
    assert order[0] == ["F0", "F1", "F2", "B0", "F3", "B1", "B2", "B3", "U"]
    assert order[1] == ["F0", "F1", "B0", "F2", "B1", "F3", "B2", "B3", "U"]
    assert order[2] == ["F0", "B0", "F1", "B1", "F2", "B2", "F3", "B3", "U"]
    few = [f"{t.phase.value}{'' if t.microbatch is None else t.microbatch}" for t in one_f_one_b(4, 2)[0]]
    assert few == ["F0", "F1", "B0", "B1", "U"]  # m < p: the warm-up is cut to m
    assert schedule_tasks("1f1b", 2, 2)[0] == "1f1b"
    with pytest.raises(PlanError, match="unknown schedule 'zigzag'"):
        schedule_tasks("zigzag", 2, 2)


# ---- the bubble --------------------------------------------------------------------------------
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p, m", [(2, 1), (2, 4), (3, 7), (4, 4), (4, 8), (4, 16), (8, 32)])
@pytest.mark.parametrize("tf, tb", [(1.0, 2.0), (1.0, 1.0)])
def test_bubble_fraction_is_p_minus_1_over_m(schedule: str, p: int, m: int, tf: float, tb: float) -> None:
    """Free communication, equal stages: t_pb / t_id = (p - 1)(tf + tb) / m(tf + tb) = (p - 1)/m (§4.2.2)."""
    result = simulate(programs(schedule, p, m), uniform(p, tf, tb))
    assert result.iteration_time == pytest.approx((m + p - 1) * (tf + tb))
    assert result.bubble_fraction == pytest.approx((p - 1) / m)
    for d in range(p):
        assert result.busy[d] == pytest.approx(m * (tf + tb))
        assert result.idle_fraction(d) == pytest.approx((p - 1) / m)


# ---- memory ------------------------------------------------------------------------------------
@pytest.mark.parametrize("p, m", [(4, 8), (3, 6), (4, 2)])
def test_peak_stash_gpipe_m_and_1f1b_p(p: int, m: int) -> None:
    """GPipe stashes every microbatch before its first backward; 1F1B at most p - s on stage s (§4.2.2)."""
    gpipe = simulate(programs("gpipe", p, m), uniform(p))
    flush = simulate(programs("1f1b", p, m), uniform(p))
    for s in range(p):
        assert gpipe.peak_bytes[s] == STATE + m * ACT
        assert flush.peak_bytes[s] == STATE + min(p - s, m) * ACT
    assert flush.memory[0][-1][1] == STATE  # every stash is released by the end of the iteration


# ---- communication -----------------------------------------------------------------------------
def test_transfer_time_and_p2p_bytes() -> None:
    """Two stages, one microbatch: F, act over the link, F, B, grad back, B."""
    cost = uniform(2, value_bytes={"h0": 400.0}, bandwidth=100.0, latency_s=0.5)
    result = simulate(programs("gpipe", 2, 1), cost)
    hop = 400.0 / 100.0 + 0.5
    assert result.iteration_time == pytest.approx(1 + hop + 1 + 2 + hop + 2)
    assert result.p2p_bytes == {0: 400.0, 1: 400.0}
    assert result.swap_in_bytes == result.swap_out_bytes == {0: 0.0, 1: 0.0}


def exchange(a_bytes: float, b_bytes: float, duplex: bool) -> float:
    """dev0 sends `a` to dev1 while dev1 sends `b` to dev0, both at time 0."""
    dev0 = Program(
        0,
        (
            Send(0, 0, Carried.ACTIVATIONS, peer=1, peer_stage=1, values=("a",)),
            Recv(0, 0, Carried.GRADIENTS, peer=1, peer_stage=1, values=("b",)),
        ),
    )
    dev1 = Program(
        1,
        (
            Send(1, 0, Carried.GRADIENTS, peer=0, peer_stage=0, values=("b",)),
            Recv(1, 0, Carried.ACTIVATIONS, peer=0, peer_stage=0, values=("a",)),
        ),
    )
    cost = SimCost(
        (0.0, 0.0), (0.0, 0.0), value_bytes={"a": a_bytes, "b": b_bytes}, bandwidth=100.0, duplex=duplex
    )
    return simulate((dev0, dev1), cost).iteration_time


def test_link_sharing_slows_concurrent_transfers() -> None:
    """Transfers in flight on one link split its bandwidth; finish times follow every change (Srifty §4.3)."""
    assert exchange(100.0, 100.0, duplex=True) == pytest.approx(1.0)  # one direction each: no sharing
    assert exchange(100.0, 100.0, duplex=False) == pytest.approx(2.0)  # both at 50 B/s
    # 50 B/s each until b is done at t = 1; then a moves its last 50 bytes alone at 100 B/s.
    assert exchange(100.0, 50.0, duplex=False) == pytest.approx(1.5)


def test_shared_link_slows_a_1f1b_pipeline() -> None:
    """In 1F1B's steady state activations and gradients cross the link at once."""
    bytes_ = {"h0": 500.0, "h1": 500.0}
    duplex = simulate(programs("1f1b", 3, 6), uniform(3, value_bytes=bytes_, bandwidth=100.0))
    shared = simulate(programs("1f1b", 3, 6), uniform(3, value_bytes=bytes_, bandwidth=100.0, duplex=False))
    assert shared.iteration_time > duplex.iteration_time


def test_allreduce_waits_for_the_group_and_costs_a_ring() -> None:
    """A tied weight on stages 0 and 2 is all-reduced before the update: 2 (n - 1)/n bytes/bandwidth."""
    tied = (SharedTensor("w", ("w0", "w2"), (0, 2), "tied-parameter"),)
    cost = uniform(3, tensor_bytes={"w": 300.0}, bandwidth=100.0)
    result = simulate(programs("gpipe", 3, 2, tied), cost)
    spans = [s for s in result.timeline if isinstance(s.instruction, (AllReduceShared, AllReduceGradNorm))]
    assert {s.device for s in spans} == {0, 2}
    assert spans[0].start == spans[1].start
    assert all(s.end - s.start == pytest.approx(2 * (2 - 1) / 2 * 300.0 / 100.0) for s in spans)
    assert result.iteration_time == pytest.approx((2 + 3 - 1) * 3 + 3.0)


def two_computes(start_second: float, concurrency: tuple[float, ...], instruction_s: float = 0.0) -> dict[int, float]:
    """Device 0 computes 1 s at t = 0; device 1 computes 1 s after a transfer that takes `start_second`."""
    dev0 = Program(0, (Send(0, 0, Carried.ACTIVATIONS, peer=1, peer_stage=1, values=("y",)),
                       Forward(0, 0)))
    dev1 = Program(1, (Recv(1, 0, Carried.ACTIVATIONS, peer=0, peer_stage=0, values=("y",)),
                       Forward(1, 0, waits=(0,))))
    cost = SimCost((1.0, 1.0), (0.0, 0.0), value_bytes={"y": start_second * 100.0}, bandwidth=100.0,
                   concurrency=concurrency, shared_devices=frozenset({0, 1}), instruction_s=instruction_s)
    result = simulate((dev0, dev1), cost)
    return {s.device: s.end for s in result.timeline if s.instruction.stream is Stream.COMPUTE}


def test_devices_sharing_a_host_slow_each_other_while_both_compute() -> None:
    """Processor sharing, as for links: each compute's speed follows how many compute at once."""
    assert two_computes(0.0, ()) == pytest.approx({0: 1.0, 1: 1.0})  # no contention model
    assert two_computes(0.0, (1.0, 0.5)) == pytest.approx({0: 2.0, 1: 2.0})  # half speed each, throughout
    # device 1 starts at 0.5: device 0 has 0.5 s left, done at 0.5 + 0.5 / 0.5 = 1.5; device 1 then
    # has 1 - 0.5 = 0.5 s left at full speed, done at 2.0
    assert two_computes(0.5, (1.0, 0.5)) == pytest.approx({0: 1.5, 1: 2.0})
    # beyond the measured counts the last throughput is split further: 3 computes at 2 * 0.5 / 3
    assert SimCost((1.0,), (1.0,), concurrency=(1.0, 0.5)).speed_with(3) == pytest.approx(1 / 3)


def test_runtime_overhead_is_charged_per_instruction() -> None:
    ends = two_computes(0.0, (), instruction_s=0.25)
    # device 0: its compute 1 s + 0.25; device 1: the transfer's 0.25 latency, then 1.25 s of compute
    assert ends == pytest.approx({0: 1.25, 1: 1.5})


def test_deadlock_is_reported() -> None:
    never = Program(0, (Recv(0, 0, Carried.ACTIVATIONS, peer=1, peer_stage=1, values=("x",)),))
    with pytest.raises(PlanError, match="deadlock"):
        simulate((never, Program(1, ())), SimCost((1.0,), (1.0,)))


# ---- exports -----------------------------------------------------------------------------------
def test_chrome_trace_has_one_event_per_instruction(tmp_path) -> None:
    progs = programs("1f1b", 3, 4)
    result = simulate(progs, uniform(3, value_bytes={"h0": 100.0, "h1": 100.0}, bandwidth=1000.0))
    path = tmp_path / "trace.json"
    result.to_chrome_trace(path)
    events = json.loads(path.read_text())["traceEvents"]
    complete = [e for e in events if e["ph"] == "X"]
    assert len(complete) == sum(len(p.instructions) for p in progs)
    assert {(e["pid"], e["args"]["index"]) for e in complete} == {
        (p.device, i) for p in progs for i in range(len(p.instructions))
    }
    for e in complete:
        assert e["tid"] in range(5) and e["dur"] >= 0
        assert e["ts"] + e["dur"] <= result.iteration_time * 1e6 * (1 + 1e-9)
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert names[(0, 0)] == "compute" and names[(2, 4)] == "p2p_out"


def test_png_gantt_chart(tmp_path) -> None:
    """A matplotlib Gantt chart: a labelled row per device stream that ran something, time in ms."""
    from matplotlib.patches import Rectangle

    from stagewise.passes.timeline import gantt_figure

    result = simulate(programs("gpipe", 2, 2), uniform(2))
    assert math.isclose(result.iteration_time, 9.0)  # (2 + 2 - 1) * (1 + 2)
    path = tmp_path / "gantt.png"
    result.to_png(path, width=300, row_height=10)
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    assert int.from_bytes(data[16:20], "big") == 300  # the width asked for, in pixels

    figure = gantt_figure(result, width=300, row_height=10)
    (axes,) = figure.axes
    rows = [t.get_text() for t in axes.get_yticklabels()]
    ran = {f"dev{s.device} {s.stream.value}" for s in result.timeline}
    assert sorted(rows) == sorted(ran) and len(rows) == len(ran)
    assert {"dev0 compute", "dev0 p2p_out", "dev0 p2p_in", "dev1 compute", "dev1 p2p_in", "dev1 p2p_out"} <= ran
    assert axes.get_xlabel() == "time (ms)"
    assert axes.get_xlim() == pytest.approx((0.0, 9000.0))
    legend = {t.get_text() for t in axes.get_legend().get_texts()}
    assert {"forward", "backward"} <= legend

    # F0 on dev0 runs over [0, 1) s: a bar in the "dev0 compute" row from 0 ms, 1000 ms wide
    row = rows.index("dev0 compute")
    bars = [b for b in axes.patches if isinstance(b, Rectangle)
            and b.get_y() < row < b.get_y() + b.get_height()]
    first = min(bars, key=lambda b: b.get_x())
    assert first.get_x() == pytest.approx(0.0) and first.get_width() == pytest.approx(1000.0)
    (forward,) = [h for h in axes.get_legend().legend_handles if h.get_label() == "forward"]
    assert first.get_facecolor() == forward.get_facecolor()


# ---- end to end --------------------------------------------------------------------------------
def test_1f1b_trains_like_eager() -> None:
    """Any consistent task order is executable; 1F1B's losses and weights equal eager SGD's."""
    import stagewise as sw

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3)
    )
    reference = copy.deepcopy(model)
    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    pipe = sw.compile(
        model, 3, (x,), loss_fn=F.cross_entropy, example_target=y, microbatches=4, schedule="1f1b"
    )
    assert pipe.plan.schedule == "1f1b"
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.01)
    for _ in range(3):
        loss = pipe.step(x, target=y)
        optimizer.zero_grad()
        expected = F.cross_entropy(reference(x), y)
        expected.backward()
        optimizer.step()
        assert float(loss) == pytest.approx(float(expected), rel=1e-5)
    state = pipe.state_dict()
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(state[name], value, rtol=1e-5, atol=1e-6)
    # the simulator reads the compiled programs as they are
    result = simulate(pipe.programs, SimCost.uniform(3, 1.0, 2.0))
    assert result.bubble_fraction == pytest.approx((3 - 1) / 4)
