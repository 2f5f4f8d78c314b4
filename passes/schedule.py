"""Schedules: the order in which each device runs its stages' forward, backward and update tasks.

Every schedule here flushes: all microbatches' gradients are accumulated before one
update, so the step equals one step on the whole minibatch whatever the order. The update is
synchronous (it uses this step's gradients) in all but 2BW.
A schedule returns one task list per device; with virtual stages a device runs several.
Every schedule runs each stage's forwards in microbatch order, and its backwards too: the first
backward sets `.grad` and each later one adds to it, so each gradient is the same float sum
((g0 + g1) + g2) ... under every schedule, and under every partition that shares no weight or
value between several stages (those parts are added per stage first), and BatchNorm's running
statistics take the microbatches in one order (tests/test_gradient_order.py).

- GPipe (Huang et al.; the baseline of Harmony and Varuna): all forwards, then all backwards.
- 1F1B (PipeDream-Flush, Narayanan §4.2.2, Fig. 4.4 top): same bubble (p - 1)/m, but after a
  warm-up each stage alternates one forward and one backward: p stashes instead of m.
- PipeDream-2BW (Narayanan §3.2.1, Fig. 3.2): 1F1B's order, asynchronous: each stage keeps two
  versions of its weights, a step's forwards and backwards use the older one, and its update
  applies their gradients to the newer: W(t+1) = W(t) - lr * grad f(W(t-1))
  (runtime/weight_versions.py).
- ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", §2.1, Fig. 3 top): 1F1B with each
  backward split into B (input gradient, on the critical path) and W (weight gradient, which can
  wait); stage s holds back its first s W passes, so every stage has p microbatches in flight and
  the W passes fill the cool-down: with equal F, B and W the bubble is (p - 1)/3m.
- Interleaved 1F1B (Megatron, Narayanan §4.2.2, Fig. 4.4 bottom): v model chunks per device,
  stage s on device s mod p; the bubble shrinks to (1/v)(p - 1)/m.
- ZB-V (Qi et al. §6, Fig. 8; passes/zb_v.py): two chunks per device in a V (device d holds stages d
  and 2p - 1 - d), backwards split as in ZB-H1: a near-zero bubble at 1F1B's peak of activations.
- Varuna (Varuna §3.2, Fig. 4): recompute instead of stash on every stage but the last, with
  the static order produced by rules 1-3; at run time a forward that is ready runs ahead of a
  recompute whose gradient is late (the opportunistic policy, runtime/executor.py).
- Harmony PP (Harmony §3, Fig. 5, Alg. 3): many packs bound wrap-around (pack k on device
  k mod N); input-batch grouping runs all microbatches through a pack before the next, so a
  pack's weights are swapped in once per pass; jit-update steps a pack right after its last
  backward. Harmony DP (Fig. 6(c)): every device runs all packs on its own microbatches.

Generators describe one pipeline lane (one data-parallel replica) with logical stages and
lane-local microbatches; `instance_tasks` maps lanes onto stage instances and devices. Stages
replicated each their own number of ways (PipeDream's 2-1 plans) form no lanes: each instance
runs GPipe or 1F1B-RR over its own microbatches (`replicated_stage_tasks`). `with_recompute` makes
chosen stages of any of these recompute instead of stash (the planner's per-stage activation policy).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from collections.abc import Set as AbstractSet

from stagewise.ir.choices import Schedule, choice_names, parse_choice
from stagewise.ir.errors import OptionError, PlanError
from stagewise.ir.instructions import Phase
from stagewise.ir.plan import Stage, Task
from stagewise.passes.zb_v import zb_v

SCHEDULES = tuple(Schedule)
REPLICATED_STAGE_SCHEDULES = (Schedule.GPIPE, Schedule.ONE_F_ONE_B)  # the schedules that run stages replicated unevenly
# Varuna's list scheduling: kind ("F", "R", "B") -> stage -> microbatch -> when it ends (None: not scheduled)
_Ends = dict[str, list[list[float | None]]]


def gpipe(n_stages: int, microbatches: int) -> list[list[Task]]:
    """All forwards, then all backwards, then the update (GPipe; §4.2.2 Fig. 4.3), each in microbatch order."""
    return [
        [Task(Phase.FORWARD, s, mb) for mb in range(microbatches)]
        + [Task(Phase.BACKWARD, s, mb) for mb in range(microbatches)]
        + [Task(Phase.UPDATE, s)]
        for s in range(n_stages)
    ]


def one_f_one_b(n_stages: int, microbatches: int) -> list[list[Task]]:
    """PipeDream-Flush: stage s warms up with min(p - s - 1, m) forwards, then runs 1F1B, then cools down.

    The warm-up fills the pipeline so that stage s's k-th backward meets the gradient that
    the later stages produced meanwhile; backwards run in microbatch order (§4.2.2).
    """
    return [alternate(s, range(microbatches), n_stages - s - 1) + [Task(Phase.UPDATE, s)] for s in range(n_stages)]


def alternate(stage: int, microbatches: Sequence[int], warmup: int) -> list[Task]:
    """`warmup` forwards, then one forward and one backward in turn, then the remaining backwards:
    the 1F1B order of one stage over its microbatches (in the order given)."""
    mbs, warmup = list(microbatches), min(warmup, len(microbatches))
    order = [Task(Phase.FORWARD, stage, mb) for mb in mbs[:warmup]]
    for i in range(len(mbs) - warmup):
        order += [Task(Phase.FORWARD, stage, mbs[warmup + i]), Task(Phase.BACKWARD, stage, mbs[i])]
    return order + [Task(Phase.BACKWARD, stage, mb) for mb in mbs[len(mbs) - warmup:]]


def zb_h1(n_stages: int, microbatches: int) -> list[list[Task]]:
    """ZB-H1: stage s runs 1F1B's warm-up (p - s - 1 forwards), then 1F1B with every backward split
    into its input gradient (B) and weight gradient (W); W of microbatch k runs after B of k + s,
    the W passes left at the end in microbatch order. So every stage holds p microbatches in flight
    at most (F to W), as 1F1B's first stage does: 1F1B's peak where stages stash alike (a later
    stage's own peak grows: 1F1B's is p - s), and its last s W passes fill the cool-down bubble. Both halves keep microbatch order, so gradients sum as under 1F1B."""
    return [_zb_h1_stage(s, n_stages, microbatches) + [Task(Phase.UPDATE, s)] for s in range(n_stages)]


def _zb_h1_stage(stage: int, n_stages: int, microbatches: int) -> list[Task]:
    weights = iter(range(microbatches))  # the W passes, in microbatch order
    order: list[Task] = []
    for task in alternate(stage, range(microbatches), n_stages - stage - 1):
        if task.phase is Phase.FORWARD:
            order.append(task)
            continue
        order.append(Task(Phase.INPUT_GRAD, stage, task.microbatch))
        if task.microbatch is not None and task.microbatch >= stage:
            order.append(Task(Phase.WEIGHT_GRAD, stage, next(weights)))
    return order + [Task(Phase.WEIGHT_GRAD, stage, mb) for mb in weights]


def interleaved(n_devices: int, chunks: int, microbatches: int) -> list[list[Task]]:
    """Megatron's interleaved 1F1B: device d runs stages d, d + p, ..., d + (v - 1) p.

    Forwards go through the device's chunks in groups of p microbatches (chunk (k // p) % v
    for the k-th forward of the device), backwards through the chunks in reverse; the warm-up
    is 2(p - d - 1) + (v - 1) p forwards (Narayanan §4.2.2). Needs m divisible by p.
    """
    p, v, m = n_devices, chunks, microbatches
    if m % p:
        raise PlanError(f"the interleaved schedule needs microbatches divisible by the {p} devices, got {m}")
    total = m * v

    def forward(d: int, k: int) -> Task:
        chunk = (k // p) % v
        return Task(Phase.FORWARD, chunk * p + d, (k // (p * v)) * p + k % p)

    def backward(d: int, k: int) -> Task:
        chunk = v - 1 - (k // p) % v
        return Task(Phase.BACKWARD, chunk * p + d, (k // (p * v)) * p + k % p)

    tasks = []
    for d in range(p):
        warmup = min(2 * (p - d - 1) + (v - 1) * p, total)
        order = [forward(d, k) for k in range(warmup)]
        for k in range(total - warmup):
            order += [forward(d, warmup + k), backward(d, k)]
        order += [backward(d, k) for k in range(total - warmup, total)]
        tasks.append(order + [Task(Phase.UPDATE, chunk * p + d) for chunk in range(v)])
    return tasks


def varuna(n_stages: int, microbatches: int) -> list[list[Task]]:
    """Varuna's static schedule (§3.2): list scheduling with uniform Tf = 1, Tb = 2, Tr = 1.

    Rule 1: stage k recomputes microbatch j so that the recompute ends as stage k+1
    finishes j's backward, not earlier. Rule 2: after a recompute, the stage waits for that
    microbatch's backward. Rule 3: of tasks ready at once, backward (and its recompute) goes
    first. The last stage keeps its activations: it runs each backward right after its
    forward. The task that can start earliest on any stage is scheduled next.

    This is the offline order; at run time Varuna deviates from it opportunistically (§3.2):
    when a stage's next task is a recompute R(m) but m's gradient has not arrived from the
    next stage, the next forward runs first if its activations are there (and one more stash
    fits in the device's memory). Only forwards move, so backwards and gradient accumulation
    keep this order. The runtime (runtime/executor.py) and the simulator (passes/simulate.py)
    both apply it to programs that recompute.
    """
    p, m = n_stages, microbatches
    end: _Ends = {kind: [[None] * m for _ in range(p)] for kind in "FRB"}
    duration = {"F": 1, "R": 1, "B": 2}
    free: list[float] = [0] * p
    next_f, next_b = [0] * p, [0] * p
    order: list[list[Task]] = [[] for _ in range(p)]
    while any(b < m for b in next_b):
        options = []
        for k in range(p):
            for ready, kind, j in _varuna_ready(k, p, m, next_f, next_b, end):
                options.append((max(ready, free[k]), "BRF".index(kind), k, kind, j))
        start, _, k, kind, j = min(options)
        free[k] = start + duration[kind]
        end[kind][k][j] = free[k]
        next_f[k] += kind == "F"
        next_b[k] += kind == "B"
        order[k].append(Task(Phase(kind), k, j, stash=kind != "F" or k == p - 1))
    return [tasks + [Task(Phase.UPDATE, k)] for k, tasks in enumerate(order)]


def _varuna_ready(k: int, p: int, m: int, next_f: list[int], next_b: list[int],
                  end: _Ends) -> list[tuple[float, str, int]]:
    """(time ready, kind, microbatch) of the tasks stage k may run next; none if it must wait."""
    j = next_b[k]
    if j >= m:
        return []
    last = k == p - 1
    if last and j < next_f[k]:
        forward_end = end["F"][k][j]
        assert forward_end is not None, (k, j)  # its forward is scheduled: j < next_f[k]
        return [(forward_end, "B", j)]
    grad_at = None if last else end["B"][k + 1][j]
    recompute_end = None if last else end["R"][k][j]
    if recompute_end is not None:  # rule 2: nothing but this microbatch's backward
        return [(max(grad_at, recompute_end), "B", j)] if grad_at is not None else []
    options: list[tuple[float, str, int]] = []
    if not last and j < next_f[k] and grad_at is not None:
        options.append((grad_at - 1, "R", j))  # rule 1
    i = next_f[k]
    inputs_at = (0 if k == 0 else end["F"][k - 1][i]) if i < m else None
    if inputs_at is not None:
        options.append((inputs_at, "F", i))
    return options


def harmony_pp(n_packs: int, n_devices: int, microbatches: int, jit_update: bool) -> list[list[Task]]:
    """Wrap-around packs with input-batch grouping (Harmony §3.2): device d runs packs d, d + N, ...

    Forward: each pack takes every microbatch before the next pack starts. Backward: packs in
    reverse (PFB = PF + Reverse(PB)), each pack's microbatches in order (the paper fixes no order
    there; microbatch order sums the gradients as every other schedule does), and (jit-update)
    the pack's update right after its last backward, while its weights and gradients are still
    on the device.
    """
    tasks = []
    for d in range(n_devices):
        packs = list(range(d, n_packs, n_devices))
        order = [Task(Phase.FORWARD, k, mb) for k in packs for mb in range(microbatches)]
        for k in reversed(packs):
            order += [Task(Phase.BACKWARD, k, mb) for mb in range(microbatches)]
            order += [Task(Phase.UPDATE, k)] if jit_update else []
        tasks.append(order + ([] if jit_update else [Task(Phase.UPDATE, k) for k in packs]))
    return tasks


def lane_tasks(name: Schedule, n_stages: int, microbatches: int, n_devices: int, jit_update: bool) -> list[list[Task]]:
    """One lane's task lists, indexed by lane device, over logical stages and local microbatches."""
    if name == Schedule.GPIPE:
        return gpipe(n_stages, microbatches)
    if name in (Schedule.ONE_F_ONE_B, Schedule.TWO_BW):
        return one_f_one_b(n_stages, microbatches)
    if name == Schedule.ZB_H1:
        return zb_h1(n_stages, microbatches)
    if name == Schedule.INTERLEAVED:
        return interleaved(n_devices, n_stages // n_devices, microbatches)
    if name == Schedule.ZB_V:
        return zb_v(n_devices, microbatches)
    if name == Schedule.VARUNA:
        return varuna(n_stages, microbatches)
    if name == Schedule.HARMONY_PP:
        return harmony_pp(n_stages, n_devices, microbatches, jit_update)
    if name == Schedule.HARMONY_DP:
        return harmony_pp(n_stages, 1, microbatches, jit_update)
    raise OptionError(f"unknown schedule '{name}'; choose one of {choice_names(Schedule)}")


def schedule_tasks(
    name: Schedule | str, n_stages: int, microbatches: int, n_devices: int | None = None, jit_update: bool = False
) -> tuple[Schedule, list[list[Task]]]:
    """The resolved schedule and each device's task list (stage s on device s mod n_devices)."""
    n_devices = n_devices or n_stages
    schedule = parse_choice(Schedule, name, "schedule ")
    resolved = Schedule.GPIPE if schedule == Schedule.AUTO else schedule
    return resolved, lane_tasks(resolved, n_stages, microbatches, n_devices, jit_update)


def instance_tasks(name: Schedule, stages: Sequence[Stage], microbatches: int, n_devices: int,
                   jit_update: bool) -> list[list[Task]]:
    """Each device's tasks when stages may be data-parallel instances (replica r, its microbatches):
    whole pipelines copied (lanes, P x D) run the schedule per lane; stages replicated each their own
    number of ways run PipeDream's 1F1B-RR (`replicated_stage_tasks`)."""
    lanes: dict[int, list[Stage]] = {}
    for stage in stages:
        lanes.setdefault(stage.replica, []).append(stage)
    positions = {s.position for s in stages}
    if any({s.position for s in lane} != positions or len({s.microbatches for s in lane}) != 1
           for lane in lanes.values()):
        return replicated_stage_tasks(name, stages, microbatches, n_devices)
    per_device: list[list[Task]] = [[] for _ in range(n_devices)]
    for lane in lanes.values():
        by_position = {s.position: s for s in lane}
        local = lane[0].microbatches or tuple(range(microbatches))
        lane_devices = sorted({s.device for s in lane})
        for tasks in lane_tasks(name, len(lane), len(local), len(lane_devices), jit_update):
            for task in tasks:
                instance = by_position[task.stage]
                mb = None if task.microbatch is None else local[task.microbatch]
                per_device[instance.device].append(Task(task.phase, instance.index, mb, task.stash))
    return per_device


def with_recompute(tasks: Sequence[Sequence[Task]], stages: AbstractSet[int]) -> list[list[Task]]:
    """Each device's tasks with `stages` recomputing (Varuna §3.2, per stage): their forwards keep only
    their inputs (no stash) and each backward is preceded by the recompute of its forward, so a stage
    holds one microbatch's stash at a time whatever the schedule keeps in flight. Forwards and
    backwards keep their order, so gradients sum as without recompute."""
    def recomputed(task: Task) -> list[Task]:
        if task.stage not in stages or task.phase is Phase.UPDATE:
            return [task]
        if task.phase is Phase.FORWARD:
            return [Task(Phase.FORWARD, task.stage, task.microbatch, stash=False)]
        if task.phase in (Phase.BACKWARD, Phase.INPUT_GRAD):
            return [Task(Phase.RECOMPUTE, task.stage, task.microbatch), task]
        if task.phase is Phase.WEIGHT_GRAD:
            return [task]
        raise PlanError(f"stage {task.stage} already recomputes ({task}); give recompute stages a schedule that stashes")
    return [[new for task in device_tasks for new in recomputed(task)] for device_tasks in tasks]


def stashes_held_once(tasks: Sequence[Sequence[Task]]) -> frozenset[int]:
    """Stages every forward of which is followed right away by its backward on its device (1F1B's last
    stage): they hold one stash at a time already, so recomputing would only add a forward."""
    adjacent: dict[int, bool] = {}
    for device_tasks in tasks:
        for i, task in enumerate(device_tasks):
            if task.phase is Phase.FORWARD:
                after = device_tasks[i + 1] if i + 1 < len(device_tasks) else None
                follows = after is not None and (after.phase, after.stage, after.microbatch) == (
                    Phase.BACKWARD, task.stage, task.microbatch)
                adjacent[task.stage] = adjacent.get(task.stage, True) and follows
    return frozenset(stage for stage, always in adjacent.items() if always)


def replicated_stage_tasks(name: Schedule, stages: Sequence[Stage], microbatches: int, n_devices: int) -> list[list[Task]]:
    """Stages replicated each their own number of ways (PipeDream §2.4.1, e.g. 2-1): every instance
    runs its own microbatches. GPipe: its forwards, its backwards, its update. 1F1B-RR
    (§2.4.2): a replica of a stage on r devices followed by w devices (itself included) keeps
    NOAM = ceil(w / r) inputs in flight, so it warms up with NOAM - 1 forwards and then alternates;
    with every stage on one device that is PipeDream-Flush's warm-up, p - s - 1."""
    if name not in REPLICATED_STAGE_SCHEDULES:
        raise PlanError(f"the {name} schedule cannot run stages replicated unevenly (each stage its own number of "
                        f"devices); use one of {', '.join(REPLICATED_STAGE_SCHEDULES)}, or replicate whole pipelines")
    ways = Counter(s.position for s in stages)
    per_device: list[list[Task]] = [[] for _ in range(n_devices)]
    for stage in sorted(stages, key=lambda s: s.index):
        mine = stage.microbatches or tuple(range(microbatches))
        if name == Schedule.GPIPE:
            order = ([Task(Phase.FORWARD, stage.index, mb) for mb in mine]
                     + [Task(Phase.BACKWARD, stage.index, mb) for mb in mine])
        else:
            following = sum(n for position, n in ways.items() if position >= stage.position)
            order = alternate(stage.index, mine, math.ceil(following / ways[stage.position]) - 1)
        per_device[stage.device] += order + [Task(Phase.UPDATE, stage.index)]
    return per_device
