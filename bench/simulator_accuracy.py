"""Simulator accuracy: the planner's predicted step time vs the measured one, over real models and plans.

    python bench/simulator_accuracy.py            # the sweep: 9 models x 1, 2, 4 devices, the planner's plans
    python bench/simulator_accuracy.py --quick    # the same sweep, 4 microbatches, fewer steps (under 2 minutes)
    python bench/simulator_accuracy.py --diagnose [--quick]   # where the time goes, 12 (4) plans of two models

The sweep (bench/_accuracy_sweep.py): every model of the zoo (Hugging Face GPT-2, Llama, BERT and T5
from tests/hf.py's small configs, a ResNet, the tied GPT, an MLP, an encoder-decoder, MobileNetV3;
bench/_accuracy_plans.py) on 1, 2 and 4 CPU devices. For each, the planner's plan with cost="profile"
is compiled and stepped: its predicted step time (pipe.plan.predicted_iteration_s), the median
measured `pipe.step` time and the relative error (predicted - measured) / measured. The analytic
model (cost="analytic", what `sw.plan` uses for absent hardware) is checked the same way, its
devices given this machine's calibrated matmul FLOP/s and copy bandwidth, for the same schedule and
microbatches (its own partition), and its plan stepped too. Then the median and worst |error| per
device count and overall (target on the CPU: median <= 10%, worst <= 25%).

The diagnosis (--diagnose), for each plan of PLANS: the same three columns, then
Diagnosis, second table: the compute F+B of a step as a multiple of what the simulator charged for
it (the sum of the stage's per-layer profiles), measured five ways:

- stage module alone: each stage's GraphModule forward + autograd backward on microbatch 0's real
  inputs (captured during warm-up), timed in the main thread with nothing else running: is the sum
  of per-layer profiles right for the whole stage?
- runtime worker alone: the same through StageWorker.forward / backward (saved-tensor hooks, pool
  accounting, input-gradient copies), still alone;
- stages together, no runtime: every device's stages in a loop in one thread per device at once,
  without the runtime: how much devices of one process slow each other (cores, GIL, memory);
- in pipeline, alone / concurrent: every instruction of the timed steps, as the executor's timeline
  of each step records it (`pipe._executor.state.step.timeline`; nothing is patched), split by whether
  another device computed during < 10% or > 90% of it; with the stream threads' CPU time over the timed
  steps (the OS's per-thread clocks: F/R/B, updates and the copies of in-process messages) and the
  share of F/R/B and U wall time they waited (for a core or the GIL);
- the optimizer update (U instructions), measured next to what the planner charges (compile times the
  user's optimizer per tensor and per byte).

The raw prediction already charges what compile measures about the runtime on this machine: the
optimizer step, a thread hand-off per instruction, the slowdown of in-process CPU devices that
compute at once (processor sharing at speeds measured on the model's costliest layer kind; with 4
devices on 2 cores that includes waiting for a core), and the wake-up cost of a compute that starts
after its device waited (a core that idled computes its next layer 15-40% slower on this machine). Two diagnostics (beside the raw figure, never
instead of it) say what is left:
A: a null model (16 x Linear(4, 4): compute the profiler puts at microseconds) is compiled with the
same devices, schedule and microbatches and stepped; the residual per-instruction overhead c that
makes the simulation of its programs match its measured step time is found by bisection, and the
real plan is simulated again with c added to every compute instruction and transfer.
B: as A, with each stage's F / B taken from "stages together, no runtime" instead of the profile
(and no contention model on top: those timings hold it).

Timing: OMP_NUM_THREADS=MKL_NUM_THREADS=1 and torch.set_num_threads(1) (bench/_common.py says why
both), so each device's compute thread uses one core; this machine has 2 cores.
Profiles go to a fresh cache directory so they are measured in this run, under the same load.
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
from dataclasses import dataclass, replace

from _accuracy_plans import PLANS, QUICK_PLANS, Model, gpt_model, mlp_model, null_model, zoo
from _accuracy_sweep import report_sweep, sweep_row
from _accuracy_timing import RECORDER, ThreadUsage, concurrent_stage_seconds, stage_seconds, step_times
from _common import start
from rich.console import Console
from rich.table import Table

import stagewise as sw
from stagewise.ir.instructions import COMPUTES, Forward, HostUpdate, Recompute, Update
from stagewise.passes.simulate import simulate


# ---- measuring -------------------------------------------------------------------------------------------
def compile_plan(model: Model, devices: int, schedule: str, m: int):
    return sw.compile(model.make(), devices, model.inputs, loss_fn=model.loss_fn, example_target=model.target,
                      schedule=schedule, microbatches=m, cost="profile")


@dataclass
class Compute:
    """Measured compute of one plan's timed steps, as ratios to what the simulator charged."""

    alone: float  # wall seconds / profiled, instructions with no other device computing (< 10% overlap)
    concurrent: float  # the same, instructions > 90% overlapped by another device's compute
    cpu: float  # the stream threads' CPU seconds over the timed steps / profiled F/R/B
    waiting: float  # 1 - that CPU / wall of every F/R/B and U: time the threads had no core
    overlap: float  # share of compute wall time during which another device computed too
    update: float  # seconds of U instructions per step
    faults: float  # the stream threads' minor page faults per F/R/B instruction
    kernel: float  # kernel (system) share of the stream threads' CPU time


def compute_ratios(pipe, steps: int) -> Compute:
    """The timed steps' instructions (RECORDER.spans, from the executor's timeline) against the profile."""
    cost = pipe._sim_cost
    spans = [span for span in RECORDER.spans if isinstance(span[1], (*COMPUTES, HostUpdate))]
    by_device = collections.defaultdict(list)
    for d, _, a, b in spans:
        by_device[d].append((a, b))
    sums = {"alone": [0.0, 0.0], "concurrent": [0.0, 0.0], "all": [0.0, 0.0]}
    overlapped = update = 0.0
    count = 0
    for d, ins, a, b in spans:
        if isinstance(ins, (Update, HostUpdate)):
            update += b - a
            continue
        others = sorted((x, y) for e, iv in by_device.items() if e != d for x, y in iv if y > a and x < b)
        covered, reach = 0.0, a
        for x, y in others:  # length of the union of the other devices' compute inside [a, b]
            x, y = max(x, reach), min(y, b)
            if y > x:
                covered += y - x
                reach = y
        share = covered / (b - a) if b > a else 0.0
        profiled = cost.forward_s[ins.stage] if isinstance(ins, (Forward, Recompute)) else cost.backward_s[ins.stage]
        overlapped += covered
        sums["all"][0] += b - a
        sums["all"][1] += profiled
        count += 1
        kind = "alone" if share < 0.1 else "concurrent" if share > 0.9 else None
        if kind:
            sums[kind][0] += b - a
            sums[kind][1] += profiled
    wall, profiled = sums["all"]
    busy = wall + update  # what the stream threads' CPU time is spent on, less the messages' copies
    usage = RECORDER.usage or ThreadUsage(float("nan"), float("nan"), 0)

    def ratio(key):
        m, p = sums[key][:2]
        return m / p if p else float("nan")

    return Compute(ratio("alone"), ratio("concurrent"), usage.cpu_s / profiled if profiled else float("nan"),
                   1 - usage.cpu_s / busy if busy else 0.0, overlapped / wall if wall else 0.0, update / steps,
                   usage.minor_faults / count if count else 0.0,
                   usage.system_s / usage.cpu_s if usage.cpu_s else float("nan"))


def with_overhead(cost, c: float):
    """c seconds more on every compute instruction and on every transfer."""
    n = len(cost.forward_s)
    update = tuple(cost.update_s) + (0.0,) * (n - len(cost.update_s))
    return replace(cost, forward_s=tuple(f + c for f in cost.forward_s), backward_s=tuple(b + c for b in cost.backward_s),
                   update_s=tuple(u + c for u in update), latency_s=cost.latency_s + c)


def fit_overhead(pipe, measured: float) -> float:
    """The per-instruction overhead c with simulate(programs, cost + c) == measured (bisection)."""
    base = pipe._sim_cost
    if simulate(pipe.plan.programs, base).iteration_time >= measured:
        return 0.0
    lo, hi = 0.0, 1e-3
    while simulate(pipe.plan.programs, with_overhead(base, hi)).iteration_time < measured:
        hi *= 2
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if simulate(pipe.plan.programs, with_overhead(base, mid)).iteration_time < measured else (lo, mid)
    return (lo + hi) / 2


def _fb_ratio(measured: dict[int, tuple[float, float]], cost) -> float:
    """Sum over stages of measured F + B over the simulator's profiled F + B."""
    profiled = sum(cost.forward_s[s] + cost.backward_s[s] for s in measured)
    return sum(f + b for f, b in measured.values()) / profiled if profiled else float("nan")


def stage_cost(cost, measured: dict[int, tuple[float, float]], contended: bool):
    """The simulator's costs with each stage's F / B replaced by measured ones; timings `contended` (taken
    with every device computing) already hold the slowdown the simulator would otherwise add."""
    forward = tuple(measured.get(s, (f, 0.0))[0] for s, f in enumerate(cost.forward_s))
    backward = tuple(measured.get(s, (0.0, b))[1] for s, b in enumerate(cost.backward_s))
    return replace(cost, forward_s=forward, backward_s=backward, concurrency=() if contended else cost.concurrency)


@dataclass
class Row:
    model: str
    devices: int
    schedule: str
    microbatches: int
    instructions: int
    predicted: float
    measured: float
    times: list
    compute: Compute
    plain: float  # stage module F+B alone / profile
    worker: float  # StageWorker F+B alone / profile
    overhead: float  # per-instruction overhead fitted on the null model
    calibrated: float  # profile + c
    staged: float  # stage-level timings through the worker + c
    concurrent: float  # stage modules timed while all devices run at once, + c
    interference: float  # those concurrent F+B / profile
    alone_faults: float  # minor page faults per worker F or B run alone
    charged_slowdown: float  # 1 / the simulator's speed of each compute with every device computing
    charged_instruction: float  # the simulator's seconds per instruction
    charged_update: float  # the simulator's seconds of optimizer updates per step


def run_plan(models: dict, key: str, devices: int, schedule: str, m: int, args) -> Row:
    model = models[key]
    pipe = compile_plan(model, devices, schedule, m)
    times = step_times(pipe, model, args.warmup, args.steps, record=True)
    compute = compute_ratios(pipe, args.steps)
    plain, worker_path, alone_faults = stage_seconds(pipe)
    together = concurrent_stage_seconds(pipe)
    null = null_model(model.target.shape[0])
    null_pipe = compile_plan(null, devices, schedule, m)
    c = fit_overhead(null_pipe, statistics.median(step_times(null_pipe, null, args.warmup, args.null_steps)))
    calibrated = simulate(pipe.plan.programs, with_overhead(pipe._sim_cost, c)).iteration_time
    staged = simulate(pipe.plan.programs, with_overhead(stage_cost(pipe._sim_cost, worker_path, False), c)).iteration_time
    concurrent = simulate(pipe.plan.programs, with_overhead(stage_cost(pipe._sim_cost, together, True), c)).iteration_time
    instructions = max(len(p.instructions) for p in pipe.plan.programs)
    cost = pipe._sim_cost
    return Row(key, devices, schedule, m, instructions, pipe.plan.predicted_iteration_s, statistics.median(times),
               times, compute, _fb_ratio(plain, cost), _fb_ratio(worker_path, cost), c, calibrated,
               staged, concurrent, _fb_ratio(together, cost), alone_faults, 1 / cost.speed_with(devices),
               cost.instruction_s, sum(cost.update_s))


# ---- the report --------------------------------------------------------------------------------------------
def err(predicted: float, measured: float) -> float:
    return (predicted - measured) / measured


def report(console: Console, rows: list[Row], models: dict, args) -> None:
    for model in models.values():
        console.print(f"  {model.key}: {model.title}")
    table = Table(title="simulator (cost='profile') vs measured step time, ms")
    cols = ("model", "dev", "schedule", "mb", "predicted", "measured median", "min / max", "error",
            "diagnostic A: + c", "its error", "diagnostic B: stages timed together + c", "its error")
    for col in cols:
        table.add_column(col, justify="left" if col in ("model", "schedule") else "right")
    for r in rows:
        table.add_row(
            r.model, str(r.devices), r.schedule, str(r.microbatches), f"{r.predicted * 1e3:.1f}",
            f"{r.measured * 1e3:.1f}", f"{min(r.times) * 1e3:.0f} / {max(r.times) * 1e3:.0f}",
            f"{err(r.predicted, r.measured):+.1%}", f"{r.calibrated * 1e3:.1f}", f"{err(r.calibrated, r.measured):+.1%}",
            f"{r.concurrent * 1e3:.1f}", f"{err(r.concurrent, r.measured):+.1%}",
        )
    console.print(table)

    def median_abs(f, subset) -> str:
        return f"{statistics.median(abs(f(r)) for r in subset):.1%}" if subset else "-"

    two = [r for r in rows if r.devices == 2]
    summary = Table(title="median |relative error| over the plans (target <= 10% for the raw prediction)")
    for col in ("prediction", "all plans", "2-device plans", "target met (all plans)"):
        summary.add_column(col, justify="right")
    raw = statistics.median(abs(err(r.predicted, r.measured)) for r in rows)
    summary.add_row("raw: pipe.plan.predicted_iteration_s", median_abs(lambda r: err(r.predicted, r.measured), rows),
                    median_abs(lambda r: err(r.predicted, r.measured), two), "yes" if raw <= 0.10 else "no")
    summary.add_row("diagnostic A: + the residual per-instruction overhead c of the null model",
                    median_abs(lambda r: err(r.calibrated, r.measured), rows),
                    median_abs(lambda r: err(r.calibrated, r.measured), two), "")
    summary.add_row("diagnostic B: stages timed with every device running at once (no runtime), + c",
                    median_abs(lambda r: err(r.concurrent, r.measured), rows),
                    median_abs(lambda r: err(r.concurrent, r.measured), two), "")
    summary.add_row("diagnostic: stages timed alone through the runtime's worker, + c",
                    median_abs(lambda r: err(r.staged, r.measured), rows),
                    median_abs(lambda r: err(r.staged, r.measured), two), "")
    console.print(summary)

    table = Table(title="where the time goes: compute F+B per step as a multiple of what the simulator charged "
                  "(the per-layer profile)")
    cols = ("model", "dev", "schedule", "mb", "stage module alone", "runtime worker alone", "stages together, no runtime",
            "in pipeline, alone",
            "in pipeline, concurrent", "CPU time in pipeline", "waiting (1 - CPU/wall)", "compute overlapped",
            "page faults per F/B: pipeline / alone", "kernel share of CPU", "update ms: measured / charged",
            "residual c µs/instr (null model)")
    for col in cols:
        table.add_column(col, justify="left" if col in ("model", "schedule") else "right")
    for r in rows:
        table.add_row(r.model, str(r.devices), r.schedule, str(r.microbatches), _ratio(r.plain), _ratio(r.worker),
                      _ratio(r.interference), _ratio(r.compute.alone), _ratio(r.compute.concurrent), _ratio(r.compute.cpu),
                      f"{r.compute.waiting:.0%}", f"{r.compute.overlap:.0%}",
                      f"{r.compute.faults:.0f} / {r.alone_faults:.0f}", f"{r.compute.kernel:.0%}",
                      f"{r.compute.update * 1e3:.1f} / {r.charged_update * 1e3:.1f}",
                      f"{r.overhead * 1e6:.0f}")
    console.print(table)
    diagnose(console, rows)


def _ratio(x: float) -> str:
    return "-" if x != x else f"{x:.2f}x"  # NaN: no instruction in that class


def _median(values) -> float:
    values = [v for v in values if v == v]
    return statistics.median(values) if values else float("nan")


def diagnose(console: Console, rows: list[Row]) -> None:
    """What the measurements say about the gap between prediction and measurement, from this run's figures."""
    two = [r for r in rows if r.devices == 2]
    four = [r for r in rows if r.devices == 4]
    med = {k: _median(getattr(r, k) for r in two) for k in ("plain", "worker", "interference", "charged_slowdown")}
    med.update({k: _median(getattr(r.compute, k) for r in two) for k in ("alone", "concurrent", "cpu", "waiting")})
    lines = [
        f"per-layer profile vs a whole stage, alone: the stage module takes {_ratio(med['plain'])} the sum of its layers' "
        f"profiles, {_ratio(med['worker'])} through the runtime's StageWorker (2-device plans, medians).",
        f"contention: with every device computing at once (no runtime) a stage takes {_ratio(med['interference'])} its "
        f"profile; the simulator charges {_ratio(med['charged_slowdown'])} for two devices computing at once (measured "
        "at compile on the model's costliest layer kind)"
        + (f"; 4-device plans on {os.cpu_count()} cores: {_ratio(_median(r.interference for r in four))} measured, "
           f"{_ratio(_median(r.charged_slowdown for r in four))} charged for four at once" if four else "") + ".",
        f"inside the running pipeline compute takes {_ratio(med['alone'])} the profile when no other device computes "
        f"and {_ratio(med['concurrent'])} beside another device; its threads' CPU time is {_ratio(med['cpu'])} the "
        f"profile and they wait for a core or the GIL {med['waiting']:.0%} of their wall time.",
        f"the runtime's own cost: the simulator charges {_median(r.charged_instruction for r in rows) * 1e6:.0f} µs per "
        f"instruction (a measured thread hand-off); fitting the null model leaves a residual of "
        f"{_median(r.overhead for r in two) * 1e6:.0f} µs with 2 devices"
        + (f", {_median(r.overhead for r in four) * 1e6:.0f} µs with 4" if four else "") + " (diagnostic A adds it).",
        f"the optimizer update: {_median(r.compute.update for r in rows) * 1e3:.2f} ms per step measured, "
        f"{_median(r.charged_update for r in rows) * 1e3:.2f} ms charged (medians; SGD).",
    ]
    console.print("[bold]diagnosis[/bold]:")
    for line in lines:
        console.print("  - " + line)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="4 microbatches (diagnosis: 4 plans), 1 warm-up + 3 timed steps")
    p.add_argument("--diagnose", action="store_true", help="where the time goes, over the plans of two models")
    p.add_argument("--devices", type=int, nargs="+", default=[1, 2, 4], help="device counts of the sweep")
    p.add_argument("--models", nargs="+", default=None, help="keys of the zoo's models to sweep (default: all)")
    p.add_argument("--microbatches", type=int, default=None, help="fixed in the sweep (default: the planner's)")
    p.add_argument("--steps", type=int, default=6, help="timed steps per plan")
    p.add_argument("--null-steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--blocks", type=int, default=8)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--mlp-blocks", type=int, default=12)
    p.add_argument("--mlp-dim", type=int, default=256)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--mlp-batch", type=int, default=256)
    p.add_argument("--no-pin", action="store_true",
                   help="do not set OMP_NUM_THREADS=MKL_NUM_THREADS=1 (some ops in new threads then use every core)")
    args = p.parse_args(argv)
    if args.quick:
        args.steps, args.warmup, args.null_steps = 3, 1, 5
        args.microbatches = args.microbatches or 4
    return args


def diagnose_plans(console: Console, args) -> None:
    models = {"gpt": gpt_model(args), "mlp": mlp_model(args)}
    rows = [run_plan(models, *plan, args) for plan in (QUICK_PLANS if args.quick else PLANS)]
    report(console, rows, models, args)


def main() -> None:
    args = parse_args()
    console = start(args, width=190, fresh_cache=True)  # profiles measured in this run
    console.print(f"torch.set_num_threads(1) (one core per device's compute thread; {os.cpu_count()} cores here); "
                  f"SGD; the planner's partition; {args.warmup} warm-up + {args.steps} timed steps per plan")
    if args.diagnose:
        diagnose_plans(console, args)
    else:
        models, rows = [m for m in zoo() if args.models is None or m.key in args.models], []
        for model in models:
            for devices in args.devices:
                rows.append(sweep_row(model, devices, args))
                console.print(f"  {model.key} on {devices}: {rows[-1].predicted * 1e3:.2f} ms predicted, "
                              f"{rows[-1].measured * 1e3:.2f} ms measured")
        report_sweep(console, models, rows)
    console.print(f"machine afterwards: load average {os.getloadavg()[0]:.2f} (1 min)")


if __name__ == "__main__":
    main()
