"""Lower per-stage task lists to per-device instruction programs.

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
    device_of = {s.index: s.device for s in stages}
    incoming = _group(transfers, key="dst", peer="src")
    outgoing = _group(transfers, key="src", peer="dst")
    programs = []
    for stage in stages:
        s = stage.index
        code: list[Instruction] = []
        for task in tasks[s]:
            if task.kind == "F":
                for src, values in incoming[s].items():
                    code.append(Instruction("recv", "p2p_in", s, None, task.microbatch, "act", device_of[src], values, (), src))
                code.append(Instruction("compute", "compute", s, "F", task.microbatch))
                for dst, values in outgoing[s].items():
                    code.append(Instruction("send", "p2p_out", s, None, task.microbatch, "act", device_of[dst], values, (), dst))
            elif task.kind == "B":
                for dst, values in _with_grad(outgoing[s], transfers, s, "src").items():
                    code.append(Instruction("recv", "p2p_in", s, None, task.microbatch, "grad", device_of[dst], values, (), dst))
                code.append(Instruction("compute", "compute", s, "B", task.microbatch))
                for src, values in _with_grad(incoming[s], transfers, s, "dst").items():
                    code.append(Instruction("send", "p2p_out", s, None, task.microbatch, "grad", device_of[src], values, (), src))
            elif task.kind == "U":
                code += _update(stage, stages, shared, clip_grad_norm)
        programs.append(Program(stage.device, tuple(code)))
    return tuple(with_events(p) for p in programs)


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
    if ins.kind == "compute" and ins.phase in ("F", "B"):
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


def _update(stage: Stage, stages, shared, clip_grad_norm: bool) -> list[Instruction]:
    code = []
    groups: dict[tuple[int, ...], list[str]] = defaultdict(list)
    for tensor in shared:
        if stage.index in tensor.stages and tensor.kind != "buffer":
            groups[tuple(stages[i].device for i in tensor.stages)].append(tensor.fqn)
    for group, names in sorted(groups.items()):
        code.append(Instruction("allreduce", "compute", stage.index, None, None, "shared-grad", None, tuple(names), group))
    if clip_grad_norm:
        everyone = tuple(s.device for s in stages)
        code.append(Instruction("allreduce", "compute", stage.index, None, None, "grad-norm", None, (), everyone))
    code.append(Instruction("compute", "compute", stage.index, "U"))
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
