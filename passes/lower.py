"""Lower per-device task lists to per-device instruction programs.

Each forward task is preceded by the receives of its incoming activations (p2p_in stream)
and followed by the sends of its outputs (p2p_out); each backward task mirrors that with
gradients. The update is preceded by one all-reduce per group of stages that hold replicas
of the same tensors (Varuna §5.2) and, with gradient clipping, an all-reduce of the squared
gradient norm over every device so the norm is the whole model's, as eager clipping sees it.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import replace

from stagewise.compiler.ir import Instruction, Program, SharedTensor, Stage, Task, Transfer


def lower(
    stages: tuple[Stage, ...],
    transfers: tuple[Transfer, ...],
    shared: tuple[SharedTensor, ...],
    tasks: list[list[Task]],
    clip_grad_norm: bool,
) -> tuple[Program, ...]:
    """`tasks[d]` is device d's task list; each task names its stage (several may share a device)."""
    device_of = {s.index: s.device for s in stages}
    incoming = _group(transfers, key="dst", peer="src")
    outgoing = _group(transfers, key="src", peer="dst")
    programs = []
    for device, device_tasks in enumerate(tasks):
        code: list[Instruction] = []
        for task in device_tasks:
            s, mb = task.stage, task.microbatch
            if task.kind == "F":
                for src, values in incoming[s].items():
                    code.append(_p2p("recv", s, mb, "act", src, device_of[src], values))
                code.append(Instruction("compute", "compute", s, "F", mb, "no-stash" if task.recompute else None))
                for dst, values in outgoing[s].items():
                    code.append(_p2p("send", s, mb, "act", dst, device_of[dst], values))
            elif task.kind == "R":
                code.append(Instruction("compute", "compute", s, "R", mb))
            elif task.kind == "B":
                for dst, values in _with_grad(outgoing[s], transfers, s, "src").items():
                    code.append(_p2p("recv", s, mb, "grad", dst, device_of[dst], values))
                code.append(Instruction("compute", "compute", s, "B", mb))
                for src, values in _with_grad(incoming[s], transfers, s, "dst").items():
                    code.append(_p2p("send", s, mb, "grad", src, device_of[src], values))
        updates = [stages[t.stage] for t in device_tasks if t.kind == "U"]
        if updates:  # every schedule ends with its updates
            code += _updates(updates, stages, shared, clip_grad_norm)
        programs.append(Program(device, tuple(code)))
    return tuple(with_events(p) for p in programs)


def _p2p(kind: str, stage: int, microbatch: int, what: str, peer_stage: int, peer: int, values) -> Instruction:
    stream = "p2p_in" if kind == "recv" else "p2p_out"
    return Instruction(kind, stream, stage, None, microbatch, what, peer, values, peer_stage=peer_stage)


def with_events(program: Program) -> Program:
    """State each instruction's intra-device dependencies as events (indices it waits for).

    A forward waits for its activations' receives, a backward for its forward and its
    gradients' receives, a send for the compute that made what it sends; all-reduces and the
    update wait for everything before them. Only waits across streams are listed: a stream
    runs its own instructions in order.
    """
    code = program.instructions
    events = []
    for i, ins in enumerate(code):
        waits = tuple(j for j in range(i) if code[j].stream != ins.stream and _waits_for(ins, code[j]))
        events.append(replace(ins, waits=_latest_per_stream(waits, code)))
    return replace(program, instructions=tuple(events))


def _waits_for(ins: Instruction, prev: Instruction) -> bool:
    same = prev.stage == ins.stage and prev.microbatch == ins.microbatch
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


def _updates(local: list[Stage], stages, shared, clip_grad_norm: bool) -> list[Instruction]:
    """The device's all-reduces, then each local stage's update.

    One all-reduce per group of stages holding replicas of the same tensors, and one for the
    gradient norm, issued once per device: the device contributes the sum over its member
    stages, so two replicas on one device (interleaved chunks) never wait on each other.
    """
    code = []
    mine = {s.index for s in local}
    groups: dict[tuple[int, ...], list[str]] = defaultdict(list)  # all-reduce groups list stages
    for tensor in shared:
        if mine & set(tensor.stages) and tensor.kind != "buffer":
            groups[tensor.stages].append(tensor.fqn)
    first = min(mine)
    for group, names in sorted(groups.items()):
        code.append(Instruction("allreduce", "compute", first, None, None, "shared-grad", None, tuple(names), group))
    if clip_grad_norm:
        everyone = tuple(s.index for s in stages)
        code.append(Instruction("allreduce", "compute", first, None, None, "grad-norm", None, (), everyone))
    code += [Instruction("compute", "compute", stage.index, "U") for stage in local]
    return code


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
