"""Lower per-device task lists to per-device instruction programs.

Each forward task is preceded by the receives of its incoming activations (p2p_in stream)
and followed by the sends of its outputs (p2p_out); each backward task mirrors that with
gradients. The update is preceded by one all-reduce per group of stages that hold replicas
of the same tensors (Varuna §5.2) and, with gradient clipping, an all-reduce of the squared
gradient norm over every device so the norm is the whole model's, as eager clipping sees it.

Clipping defers every update until that norm is known. Where a device swaps (Harmony §4.4)
it cannot hold every stage's gradients for it, so the deferred updates run in stages: each
stage's gradients come in once they are final (after its shared tensors' all-reduce), its
part of the squared norm is counted (`GradNormPart`)
and they go back out; one `AllReduceGradNorm` sums the parts across devices; then each
stage in turn brings in its weights, gradients and optimizer state, scales its gradients
(`Update(clip=True)`), updates, and writes back.

With the optimizer on the host (Harmony's CPU update, ZeRO-Offload) an update sends the
stage's gradients to host memory (`SwapOut` of the gradients), steps the host master weights there
(`HostUpdate`, on the swap-out stream: the device computes on meanwhile) and copies them
back (`SwapIn` of the weights) to a stage that keeps its weights on the device.

A split backward (zero bubble's B and W) lowers as the backward it halves: its input gradient
`InputGrad` with the receives and sends, its weight gradient `WeightGrad` alone; the stash stays
on the device from B to W, and W is what brings the stage's gradients in.

A stage whose stashed activations are swapped (Harmony's sX, passes/swap.py) writes each
microbatch's stash out after its forward (`StashOut`, after the sends that read its
outputs) and reads it back before the backward (`StashIn`); the stash-in depends only on
that swap-out and on the stash-residency bound, so the swap-in stream prefetches it while the
compute stream runs the tasks before the backward.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field

from stagewise.ir.instructions import (
    AllReduceGradNorm,
    AllReduceShared,
    Backward,
    Carried,
    Forward,
    GradNormPart,
    HostUpdate,
    InputGrad,
    Instruction,
    Phase,
    Recompute,
    Recv,
    Send,
    State,
    Update,
    WeightGrad,
)
from stagewise.ir.plan import SharedTensor, Stage, Task, Transfer
from stagewise.ir.program import Program, validate
from stagewise.passes.events import with_events
from stagewise.passes.swap import Residency, StateSwap, SwapPlan

_Groups = dict[tuple[int, ...], list[str]]  # all-reduce groups: the stages of each, and the tensors it sums


@dataclass(frozen=True)
class _Wiring:
    """What every device's lowering reads: who sends what to whom, and the all-reduce groups."""

    stages: tuple[Stage, ...]
    transfers: tuple[Transfer, ...]
    groups: _Groups
    clip: bool
    swap: SwapPlan
    on_host: bool
    by_index: dict[int, Stage] = field(init=False)
    device_of: dict[int, int] = field(init=False)
    incoming: dict = field(init=False)
    outgoing: dict = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "by_index", {s.index: s for s in self.stages})
        object.__setattr__(self, "device_of", {s.index: s.device for s in self.stages})
        object.__setattr__(self, "incoming", _group(self.transfers, key="dst", peer="src"))
        object.__setattr__(self, "outgoing", _group(self.transfers, key="src", peer="dst"))

    @property
    def everyone(self) -> tuple[int, ...]:
        return tuple(s.index for s in self.stages)

    def jit(self, stage: int) -> bool:
        return _jit(stage, self.groups, self.by_index, self.clip)

    def takers(self, by_peer: dict[int, tuple[str, ...]], microbatch: int) -> dict[int, tuple[str, ...]]:
        """The peers that process `microbatch`: a replica of a stage exchanges each microbatch only
        with the instance of the neighbouring stage that takes it (an instance with no
        microbatches listed takes them all)."""
        return {peer: values for peer, values in by_peer.items()
                if not self.by_index[peer].microbatches or microbatch in self.by_index[peer].microbatches}


def lower(
    stages: tuple[Stage, ...],
    transfers: tuple[Transfer, ...],
    shared: tuple[SharedTensor, ...],
    tasks: list[list[Task]],
    clip_grad_norm: bool,
    swap: SwapPlan | None = None,
    optimizer_on_host: bool = False,
) -> tuple[Program, ...]:
    """`tasks[d]` is device d's task list; each task names its stage (several may share a device).
    The programs are validated (stagewise.ir.program.validate) before they are returned."""
    wiring = _Wiring(stages, transfers, _groups(shared), clip_grad_norm, swap or SwapPlan(), optimizer_on_host)
    programs = tuple(with_events(Program(device, tuple(_lower_device(device_tasks, wiring))))
                     for device, device_tasks in enumerate(tasks))
    validate(programs)
    return programs


def _lower_device(device_tasks: list[Task], wiring: _Wiring) -> list[Instruction]:
    """One device's instructions: its runs of tasks with their swaps, then the deferred updates."""
    code: list[Instruction] = []
    residency = Residency(wiring.swap, code)
    emitted: set[tuple[int, ...]] = set()
    deferred: list[int] = []
    updated: set[int] = set()  # stages whose device weights an update changed
    runs = _runs(device_tasks)
    later = [t.stage for t in device_tasks if t.phase is Phase.UPDATE and not wiring.jit(t.stage)]
    staged = bool(later) and (wiring.on_host or (wiring.clip and any(wiring.swap.swaps(s) for s in later)))
    last_work = max((r for r, run in enumerate(runs) if any(t.phase is not Phase.UPDATE for t in run)), default=-1)
    adjacent = _adjacent(device_tasks)
    for r, run in enumerate(runs):
        for task in run:
            if task.phase is Phase.UPDATE:
                _lower_update(task.stage, wiring, residency, code, emitted, deferred, updated)
            else:
                _lower_work(task, wiring, residency, code, adjacent)
        if wiring.swap.mode == StateSwap.HARMONY and (r + 1 == len(runs) or runs[r + 1][0].stage != run[0].stage):
            if not (staged and r >= last_work):  # the staged updates may start with the last run's state
                _end_of_run(run, residency, run[0].stage in updated)
    if staged:
        _staged_updates(deferred, residency, code, wiring.groups, emitted, wiring.clip, wiring.on_host, wiring.everyone)
    elif deferred:
        _deferred_updates(deferred, wiring, residency, code, emitted)
    return code


def _lower_update(s: int, wiring: _Wiring, residency: Residency, code: list, emitted: set, deferred: list[int],
                  updated: set[int]) -> None:
    """An update right after the stage's last backward (jit), or deferred to the end of the program."""
    if not wiring.jit(s):
        deferred.append(s)
        return
    code += _all_reduces([s], wiring.groups, emitted, residency)
    if wiring.on_host:
        _host_update(s, residency, code, clip=False)
    else:
        _update(s, residency, code, write_back=wiring.swap.mode == StateSwap.PER_DEVICE)
        updated.add(s)


def _lower_work(task: Task, wiring: _Wiring, residency: Residency, code: list, adjacent: set) -> None:
    """A forward, recompute or backward with the state it needs brought in and its stash moved."""
    s, mb = task.stage, task.microbatch
    assert mb is not None, task  # an update task lowers in _lower_update
    residency.need(s, State.WEIGHTS)
    stashes = task.phase is Phase.RECOMPUTE or (task.phase is Phase.FORWARD and task.stash)
    waits = residency.stash_arrives(s, mb) if stashes else ()
    writes_grads = task.phase in (Phase.BACKWARD, Phase.WEIGHT_GRAD)  # a split backward's W adds them
    if writes_grads:
        residency.need(s, State.GRADS)
    if task.phase in (Phase.BACKWARD, Phase.INPUT_GRAD):
        residency.stash_in(s, mb)
    compute = _emit_task(task, code, wiring, waits)
    if task.phase.ends_stash:
        residency.stash_ends_at(s, mb, compute)
    elif task.phase is Phase.FORWARD and stashes and wiring.swap.swaps_stash(s) and (s, mb) not in adjacent:
        residency.stash_out(s, mb)
    if wiring.swap.mode == StateSwap.PER_DEVICE:
        residency.evict(s, State.WEIGHTS, write=True)
        if writes_grads:
            residency.evict(s, State.GRADS, write=True)


def _deferred_updates(deferred: list[int], wiring: _Wiring, residency: Residency, code: list, emitted: set) -> None:
    """Updates after every backward: the shared all-reduces, the global norm, then each step."""
    for s in deferred:
        residency.need(s, State.GRADS)
    code += _all_reduces(deferred, wiring.groups, emitted, residency)
    if wiring.clip:
        code.append(AllReduceGradNorm(deferred[0], wiring.everyone))
    for s in deferred:
        _update(s, residency, code, write_back=True)


def _emit_task(task: Task, code: list, wiring: _Wiring, waits: tuple[int, ...] = ()) -> int:
    """A forward, recompute or backward (or half of one) with its receives before and its sends after; returns the
    compute's index (`waits`: events the compute waits for beyond its receives)."""
    s, mb = task.stage, task.microbatch
    assert mb is not None, task
    incoming, outgoing = wiring.takers(wiring.incoming[s], mb), wiring.takers(wiring.outgoing[s], mb)
    if task.phase is Phase.FORWARD:
        code += [_p2p(Recv, s, mb, Carried.ACTIVATIONS, src, wiring, values) for src, values in incoming.items()]
        code.append(Forward(s, mb, stash=task.stash, waits=waits))
        compute = len(code) - 1
        code += [_p2p(Send, s, mb, Carried.ACTIVATIONS, dst, wiring, values) for dst, values in outgoing.items()]
    elif task.phase is Phase.RECOMPUTE:
        code.append(Recompute(s, mb, waits=waits))
        compute = len(code) - 1
    elif task.phase is Phase.WEIGHT_GRAD:  # nothing to receive or send: its input gradient did both
        code.append(WeightGrad(s, mb, waits=waits))
        compute = len(code) - 1
    else:
        grads_in = _with_grad(outgoing, wiring.transfers, s, "src")
        code += [_p2p(Recv, s, mb, Carried.GRADIENTS, dst, wiring, values) for dst, values in grads_in.items()]
        code.append((InputGrad if task.phase is Phase.INPUT_GRAD else Backward)(s, mb, waits=waits))
        compute = len(code) - 1
        grads_out = _with_grad(incoming, wiring.transfers, s, "dst")
        code += [_p2p(Send, s, mb, Carried.GRADIENTS, src, wiring, values) for src, values in grads_out.items()]
    return compute


def _adjacent(tasks: list[Task]) -> set[tuple[int, int | None]]:
    """(stage, microbatch) whose backward is the device's next task after its forward: a stash that
    would come straight back from host memory stays on the device."""
    return {(t.stage, t.microbatch) for t, after in zip(tasks, tasks[1:], strict=False)
            if t.phase is Phase.FORWARD and after.phase is Phase.BACKWARD
            and (after.stage, after.microbatch) == (t.stage, t.microbatch)}


def _runs(tasks: list[Task]) -> list[list[Task]]:
    """Maximal runs of consecutive tasks of one stage: the unit that keeps state resident."""
    runs: list[list[Task]] = []
    for task in tasks:
        if runs and runs[-1][0].stage == task.stage:
            runs[-1].append(task)
        else:
            runs.append([task])
    return runs


def _end_of_run(run: list[Task], residency: Residency, updated: bool) -> None:
    """Harmony: after a pack's run, write back what changed and free what did not (the weights
    changed only if the run updated them on the device: a deferred or host update leaves them)."""
    s = run[0].stage
    if any(t.phase in (Phase.BACKWARD, Phase.WEIGHT_GRAD) for t in run) and not any(t.phase is Phase.UPDATE for t in run):
        residency.evict(s, State.GRADS, write=True)  # the update comes later (deferred)
    residency.evict(s, State.WEIGHTS, write=updated)
    residency.evict(s, State.OPTIMIZER, write=True)


def _update(stage: int, residency: Residency, code: list, write_back: bool, clip: bool = False) -> None:
    """The optimizer step on the device; with `clip` it scales the gradients by the clip coefficient
    first (their norm was counted ahead, part by part)."""
    residency.need(stage, State.WEIGHTS)
    residency.need(stage, State.GRADS)
    residency.need(stage, State.OPTIMIZER)
    code.append(Update(stage, clip=clip))
    residency.consumed(stage, State.GRADS)
    if write_back:
        residency.evict(stage, State.WEIGHTS, write=True)
        residency.evict(stage, State.OPTIMIZER, write=True)


def _host_update(stage: int, residency: Residency, code: list, clip: bool) -> None:
    """The optimizer step on the host: gradients out, the host steps its masters (on the swap-out
    stream, after the gradients' copy), the device copy of the weights refreshed or freed."""
    residency.grads_to_host(stage)
    code.append(HostUpdate(stage, clip=clip))
    residency.consumed(stage, State.GRADS)
    residency.refresh(stage)


def _staged_updates(deferred: list[int], residency: Residency, code: list, groups: _Groups, emitted: set, clip: bool,
                    on_host: bool, everyone: tuple[int, ...]) -> None:
    """Deferred updates that hold one stage's (or one shared group's) gradients at a time.

    Shared groups are summed in the same (sorted) order on every device; a stage's gradients are
    final once every group it belongs to is summed: then its norm part is counted and they leave
    the device (to the host optimizer, or written back until the update needs them; the last
    stage counted keeps its state and updates first). The grad-norm all-reduce of the parts is
    the one every device joins, as without swapping.
    """
    settled: set[int] = set()

    def settle(s: int, keep: bool = False) -> None:
        if clip:
            code.append(GradNormPart(s))
        if on_host:
            residency.grads_to_host(s)
        elif not keep:
            residency.evict(s, State.WEIGHTS, write=False)  # gradients written back, weights unchanged
        settled.add(s)

    for group, names in sorted(groups.items()):
        members = [s for s in deferred if s in group]
        if group in emitted or not members:
            continue
        residency.keep_only(members)
        code.extend(_all_reduces(members, {group: names}, emitted, residency))
        for s in members:
            if all(g in emitted for g in groups if s in g):
                settle(s)
            else:
                residency.evict(s, State.WEIGHTS, write=False)  # until its other groups are summed
    rest = [s for s in deferred if s not in settled]
    for s in rest:
        residency.keep_only([s])
        if clip and not on_host:
            residency.need(s, State.GRADS)  # the part is counted on the device
        settle(s, keep=s == rest[-1])
    kept = rest[-1:] if not on_host else []
    residency.keep_only(kept)
    if clip:
        code.append(AllReduceGradNorm(deferred[0], everyone))
    for s in kept + [s for s in deferred if s not in kept]:
        if on_host:
            _host_update(s, residency, code, clip)
        else:
            _update(s, residency, code, write_back=True, clip=clip)


def _groups(shared: tuple[SharedTensor, ...]) -> _Groups:
    """All-reduce groups (tuples of stages) and the tensors each sums."""
    groups: dict[tuple[int, ...], list[str]] = defaultdict(list)
    for tensor in shared:
        if tensor.summed:
            groups[tensor.stages].append(tensor.fqn)
    return groups


def _jit(stage: int, groups: _Groups, by_index: dict[int, Stage], clip_grad_norm: bool) -> bool:
    """Update right away unless a global reduction or a tie to another position must come first.

    Replicas of one pack reach their all-reduce in the same order on every device, so that
    all-reduce may follow the pack's last backward; a tie between two positions (embedding
    and LM head) must wait until every device has finished the backward of both.
    """
    if clip_grad_norm:
        return False
    return all(len({by_index[m].position for m in group}) == 1 for group in groups if stage in group)


def _all_reduces(local: list[int], groups: _Groups, emitted: set, residency: Residency) -> list[Instruction]:
    """One all-reduce per group touching `local` stages, once per device (summing its members)."""
    code: list[Instruction] = []
    for group, names in sorted(groups.items()):
        if group in emitted or not set(local) & set(group):
            continue
        emitted.add(group)
        for s in local:
            residency.need(s, State.GRADS)
        code.append(AllReduceShared(min(set(local) & set(group)), group, tuple(names)))
    return code


def _p2p(kind: type[Send] | type[Recv], stage: int, microbatch: int, carries: Carried, peer_stage: int,
         wiring: _Wiring, values: tuple[str, ...]) -> Send | Recv:
    return kind(stage, microbatch, carries, wiring.device_of[peer_stage], peer_stage, values)


def _group(transfers: Iterable[Transfer], key: str, peer: str) -> dict[int, dict[int, tuple[str, ...]]]:
    grouped: dict[int, dict[int, list[str]]] = defaultdict(lambda: defaultdict(list))
    for t in transfers:
        grouped[getattr(t, key)][getattr(t, peer)].append(t.value)
    return defaultdict(dict, {k: {p: tuple(v) for p, v in sorted(d.items())} for k, d in grouped.items()})


def _with_grad(by_peer: dict[int, tuple[str, ...]], transfers: Iterable[Transfer], stage: int, side: str) -> dict[int, tuple[str, ...]]:
    """Keep only values whose gradient flows back over the transfer."""
    needs = {(t.value, t.src, t.dst) for t in transfers if t.requires_grad}
    kept = {}
    for peer, values in by_peer.items():
        src, dst = (stage, peer) if side == "src" else (peer, stage)
        chosen = tuple(v for v in values if (v, src, dst) in needs)
        if chosen:
            kept[peer] = chosen
    return kept
