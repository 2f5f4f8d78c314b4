"""Lower per-device task lists to per-device instruction programs.

Each forward task is preceded by the receives of its incoming activations (p2p_in stream)
and followed by the sends of its outputs (p2p_out); each backward task mirrors that with
gradients. The update is preceded by one all-reduce per group of stages that hold replicas
of the same tensors (Varuna §5.2) and, with gradient clipping, an all-reduce of the squared
gradient norm over every device so the norm is the whole model's, as eager clipping sees it.

Clipping defers every update until that norm is known. Where a device swaps (Harmony §4.4)
it cannot hold every stage's gradients for it, so the deferred updates run in stages: each
stage's gradients come in once they are final (after its shared tensors' all-reduce), its
part of the squared norm is counted (`allreduce grad-norm-part`, a group of that one stage)
and they go back out; one `allreduce grad-norm` sums the parts across devices; then each
stage in turn brings in its weights, gradients and optimizer state, scales its gradients
(`compute U clip`), updates, and writes back.

With the optimizer on the host (Harmony's CPU update, ZeRO-Offload) an update sends the
stage's gradients to host memory (`swap_out grads`), steps the host master weights there
(`compute U host`, on the swap-out stream: the device computes on meanwhile) and copies them
back (`swap_in weights`) to a stage that keeps its weights on the device.

A stage whose stashed activations are swapped (Harmony's sX, passes/swap.py) writes each
microbatch's stash out after its forward (`swap_out stash`, after the sends that read its
outputs) and reads it back before the backward (`swap_in stash`); the swap-in depends only on
that swap-out and on the stash-residency bound, so the swap-in stream prefetches it while the
compute stream runs the tasks before the backward.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import replace

from stagewise.ir.plan import Instruction, Program, SharedTensor, Stage, Task, Transfer
from stagewise.passes.swap import Residency, SwapPlan


def lower(
    stages: tuple[Stage, ...],
    transfers: tuple[Transfer, ...],
    shared: tuple[SharedTensor, ...],
    tasks: list[list[Task]],
    clip_grad_norm: bool,
    swap: SwapPlan | None = None,
    optimizer_on_host: bool = False,
) -> tuple[Program, ...]:
    """`tasks[d]` is device d's task list; each task names its stage (several may share a device)."""
    swap = swap or SwapPlan()
    by_index = {s.index: s for s in stages}
    device_of = {s.index: s.device for s in stages}
    incoming = _group(transfers, key="dst", peer="src")
    outgoing = _group(transfers, key="src", peer="dst")
    groups = _groups(shared)
    programs = []
    for device, device_tasks in enumerate(tasks):
        code: list[Instruction] = []
        residency = Residency(swap, code)
        emitted: set[tuple[int, ...]] = set()
        deferred: list[int] = []
        updated: set[int] = set()  # stages whose device weights an update changed
        runs = _runs(device_tasks)
        adjacent = _adjacent(device_tasks)
        later = [t.stage for t in device_tasks if t.kind == "U" and not _jit(t.stage, groups, by_index, clip_grad_norm)]
        staged = bool(later) and (optimizer_on_host or (clip_grad_norm and any(swap.swaps(s) for s in later)))
        last_work = max((r for r, run in enumerate(runs) if any(t.kind != "U" for t in run)), default=-1)
        for r, run in enumerate(runs):
            for task in run:
                s = task.stage
                if task.kind == "U":
                    if not _jit(s, groups, by_index, clip_grad_norm):
                        deferred.append(s)
                        continue
                    code += _all_reduces([s], groups, emitted, residency)
                    if optimizer_on_host:
                        _host_update(s, residency, code, clip=False)
                    else:
                        _update(s, residency, code, write_back=swap.mode == "per-device")
                        updated.add(s)
                    continue
                residency.need(s, "weights")
                stashes = task.kind == "R" or (task.kind == "F" and not task.recompute)
                waits = residency.stash_arrives(s, task.microbatch) if stashes else ()
                if task.kind == "B":
                    residency.need(s, "grads")
                    residency.stash_in(s, task.microbatch)
                compute = _emit_task(task, code, incoming, outgoing, transfers, device_of, waits)
                if task.kind == "B":
                    residency.stash_ends_at(s, task.microbatch, compute)
                elif task.kind == "F" and stashes and swap.swaps_stash(s) and (s, task.microbatch) not in adjacent:
                    residency.stash_out(s, task.microbatch)
                if swap.mode == "per-device":
                    residency.evict(s, "weights", write=True)
                    if task.kind == "B":
                        residency.evict(s, "grads", write=True)
            if swap.mode == "harmony" and (r + 1 == len(runs) or runs[r + 1][0].stage != run[0].stage):
                if not (staged and r >= last_work):  # the staged updates may start with the last run's state
                    _end_of_run(run, residency, run[0].stage in updated)
        if staged:
            everyone = tuple(st.index for st in stages)
            _staged_updates(deferred, residency, code, groups, emitted, clip_grad_norm, optimizer_on_host, everyone)
        elif deferred:
            for s in deferred:
                residency.need(s, "grads")
            code += _all_reduces(deferred, groups, emitted, residency)
            if clip_grad_norm:
                everyone = tuple(st.index for st in stages)
                code.append(Instruction("allreduce", "compute", deferred[0], None, None, "grad-norm", None, (), everyone))
            for s in deferred:
                _update(s, residency, code, write_back=True)
        programs.append(Program(device, tuple(code)))
    return tuple(with_events(p) for p in programs)


def _emit_task(task: Task, code: list, incoming, outgoing, transfers, device_of, waits: tuple[int, ...] = ()) -> int:
    """A forward, recompute or backward with its receives before and its sends after; returns the
    compute's index (`waits`: events the compute waits for beyond its receives)."""
    s, mb = task.stage, task.microbatch
    if task.kind == "F":
        for src, values in incoming[s].items():
            code.append(_p2p("recv", s, mb, "act", src, device_of[src], values))
        code.append(Instruction("compute", "compute", s, "F", mb, "no-stash" if task.recompute else None, waits=waits))
        compute = len(code) - 1
        for dst, values in outgoing[s].items():
            code.append(_p2p("send", s, mb, "act", dst, device_of[dst], values))
    elif task.kind == "R":
        code.append(Instruction("compute", "compute", s, "R", mb, waits=waits))
        compute = len(code) - 1
    elif task.kind == "B":
        for dst, values in _with_grad(outgoing[s], transfers, s, "src").items():
            code.append(_p2p("recv", s, mb, "grad", dst, device_of[dst], values))
        code.append(Instruction("compute", "compute", s, "B", mb, waits=waits))
        compute = len(code) - 1
        for src, values in _with_grad(incoming[s], transfers, s, "dst").items():
            code.append(_p2p("send", s, mb, "grad", src, device_of[src], values))
    return compute


def _adjacent(tasks: list[Task]) -> set[tuple[int, int]]:
    """(stage, microbatch) whose backward is the device's next task after its forward: a stash that
    would come straight back from host memory stays on the device."""
    return {(t.stage, t.microbatch) for t, after in zip(tasks, tasks[1:], strict=False)
            if t.kind == "F" and after.kind == "B" and (after.stage, after.microbatch) == (t.stage, t.microbatch)}


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
    if any(t.kind == "B" for t in run) and not any(t.kind == "U" for t in run):
        residency.evict(s, "grads", write=True)  # the update comes later (deferred)
    residency.evict(s, "weights", write=updated)
    residency.evict(s, "optimizer", write=True)


def _update(stage: int, residency: Residency, code: list, write_back: bool, clip: bool = False) -> None:
    """The optimizer step on the device; with `clip` it scales the gradients by the clip coefficient
    first (their norm was counted ahead, part by part)."""
    residency.need(stage, "weights")
    residency.need(stage, "grads")
    residency.need(stage, "optimizer")
    code.append(Instruction("compute", "compute", stage, "U", what="clip" if clip else None))
    residency.consumed(stage, "grads")
    if write_back:
        residency.evict(stage, "weights", write=True)
        residency.evict(stage, "optimizer", write=True)


def _host_update(stage: int, residency: Residency, code: list, clip: bool) -> None:
    """The optimizer step on the host: gradients out, the host steps its masters (on the swap-out
    stream, after the gradients' copy), the device copy of the weights refreshed or freed."""
    residency.grads_to_host(stage)
    code.append(Instruction("compute", "swap_out", stage, "U", what="host-clip" if clip else "host"))
    residency.consumed(stage, "grads")
    residency.refresh(stage)


def _staged_updates(deferred: list[int], residency: Residency, code: list, groups, emitted: set, clip: bool,
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
            code.append(Instruction("allreduce", "compute", s, what="grad-norm-part", group=(s,)))
        if on_host:
            residency.grads_to_host(s)
        elif not keep:
            residency.evict(s, "weights", write=False)  # gradients written back, weights unchanged
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
                residency.evict(s, "weights", write=False)  # until its other groups are summed
    rest = [s for s in deferred if s not in settled]
    for s in rest:
        residency.keep_only([s])
        if clip and not on_host:
            residency.need(s, "grads")  # the part is counted on the device
        settle(s, keep=s == rest[-1])
    kept = rest[-1:] if not on_host else []
    residency.keep_only(kept)
    if clip:
        code.append(Instruction("allreduce", "compute", deferred[0], None, None, "grad-norm", None, (), everyone))
    for s in kept + [s for s in deferred if s not in kept]:
        if on_host:
            _host_update(s, residency, code, clip)
        else:
            _update(s, residency, code, write_back=True, clip=clip)


def _groups(shared: tuple[SharedTensor, ...]) -> dict[tuple[int, ...], list[str]]:
    """All-reduce groups (tuples of stages) and the tensors each sums."""
    groups: dict[tuple[int, ...], list[str]] = defaultdict(list)
    for tensor in shared:
        if tensor.kind != "buffer":
            groups[tensor.stages].append(tensor.fqn)
    return groups


def _jit(stage: int, groups, by_index: dict[int, Stage], clip_grad_norm: bool) -> bool:
    """Update right away unless a global reduction or a tie to another position must come first.

    Replicas of one pack reach their all-reduce in the same order on every device, so that
    all-reduce may follow the pack's last backward; a tie between two positions (embedding
    and LM head) must wait until every device has finished the backward of both.
    """
    if clip_grad_norm:
        return False
    return all(len({by_index[m].position for m in group}) == 1 for group in groups if stage in group)


def _all_reduces(local: list[int], groups, emitted: set, residency: Residency) -> list[Instruction]:
    """One all-reduce per group touching `local` stages, once per device (summing its members)."""
    code = []
    for group, names in sorted(groups.items()):
        if group in emitted or not set(local) & set(group):
            continue
        emitted.add(group)
        for s in local:
            residency.need(s, "grads")
        code.append(Instruction("allreduce", "compute", min(set(local) & set(group)), None, None, "shared-grad", None,
                                tuple(names), group))
    return code


def _p2p(kind: str, stage: int, microbatch: int, what: str, peer_stage: int, peer: int, values) -> Instruction:
    stream = "p2p_in" if kind == "recv" else "p2p_out"
    return Instruction(kind, stream, stage, None, microbatch, what, peer, values, peer_stage=peer_stage)


def with_events(program: Program) -> Program:
    """State each instruction's intra-device dependencies as events (indices it waits for).

    A forward waits for its activations' receives, a backward for its forward and its
    gradients' receives (and its stash's swap-in), a send for the compute that made what it
    sends, a stash's swap-out for its forward and sends, its swap-in for that swap-out;
    all-reduces and the update wait for everything before them but stash swaps. Only waits
    across streams are listed: a stream runs its own instructions in order.
    """
    code = program.instructions
    events = []
    for i, ins in enumerate(code):
        derived = [j for j in range(i) if code[j].stream != ins.stream and _waits_for(ins, code[j])]
        explicit = [j for j in ins.waits if code[j].stream != ins.stream]
        events.append(replace(ins, waits=_latest_per_stream(tuple(derived + explicit), code)))
    return replace(program, instructions=tuple(events))


def _waits_for(ins: Instruction, prev: Instruction) -> bool:
    same = prev.stage == ins.stage and prev.microbatch == ins.microbatch
    if ins.kind in ("swap_in", "swap_out") and ins.what == "stash":
        if ins.kind == "swap_out":  # after the forward that stashed it and the sends that read its outputs
            return same and ((prev.kind == "compute" and prev.phase in ("F", "R"))
                             or (prev.kind == "send" and prev.what == "act"))
        return same and prev.kind == "swap_out" and prev.what == "stash"  # back only once it is out
    if prev.kind in ("swap_in", "swap_out") and prev.what == "stash":  # (the residency bound is explicit)
        return prev.kind == "swap_in" and ins.kind == "compute" and ins.phase == "B" and same
    if prev.kind == "swap_in" and ins.kind in ("compute", "allreduce"):
        return prev.stage == ins.stage or ins.kind == "allreduce"  # state must be on the device
    if ins.kind in ("swap_out", "free"):  # evict after the work that used or changed it
        return prev.stream == "compute" or (prev.kind == "swap_in" and prev.stage == ins.stage)
    if ins.kind == "swap_in":  # after this stage's earlier evictions (and the buffering-depth event)
        updated_on_host = prev.kind == "compute" and prev.phase == "U"  # the master it copies in
        return (prev.kind in ("swap_out", "free") or updated_on_host) and prev.stage == ins.stage
    if ins.kind == "compute" and ins.phase in ("F", "B"):  # R re-runs F on inputs it already has
        received = {"F": "act", "B": "grad"}[ins.phase]
        return same and prev.kind == "recv" and prev.what == received
    if ins.kind == "send":
        produced = {"act": "F", "grad": "B"}[ins.what]
        return same and prev.kind == "compute" and prev.phase == produced
    return ins.kind in ("allreduce", "compute")


def _latest_per_stream(waits: tuple[int, ...], code) -> tuple[int, ...]:
    """Waiting for the last awaited instruction of a stream implies the earlier ones (FIFO)."""
    latest: dict[str, int] = {}
    for j in waits:
        latest[code[j].stream] = max(j, latest.get(code[j].stream, -1))
    return tuple(sorted(latest.values()))


def _group(transfers, key: str, peer: str) -> dict[int, dict[int, tuple[str, ...]]]:
    grouped: dict[int, dict[int, list[str]]] = defaultdict(lambda: defaultdict(list))
    for t in transfers:
        grouped[getattr(t, key)][getattr(t, peer)].append(t.value)
    return defaultdict(dict, {k: {p: tuple(v) for p, v in sorted(d.items())} for k, d in grouped.items()})


def _with_grad(by_peer: dict[int, tuple[str, ...]], transfers, stage: int, side: str) -> dict[int, tuple[str, ...]]:
    """Keep only values whose gradient flows back over the transfer."""
    needs = {(t.value, t.src, t.dst) for t in transfers if t.requires_grad}
    kept = {}
    for peer, values in by_peer.items():
        src, dst = (stage, peer) if side == "src" else (peer, stage)
        chosen = tuple(v for v in values if (v, src, dst) in needs)
        if chosen:
            kept[peer] = chosen
    return kept
