"""Device programs: the ordered instructions one device runs in one iteration, their printed form,
and the checks every lowered program passes before anything executes or simulates it.

`validate` turns a mistake in lowering (an event on a later instruction, a send nobody receives,
an all-reduce one member never joins) into a PlanError naming the instruction, instead of a
"deadlock" that surfaces only when the programs run.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass

from stagewise.ir.errors import PlanError
from stagewise.ir.instructions import (
    ALL_REDUCES,
    KINDS,
    AllReduceGradNorm,
    AllReduceShared,
    GradNormPart,
    HostUpdate,
    InputGrad,
    Instruction,
    Recv,
    Send,
    Update,
    WeightGrad,
    message_keys,
    parse_instruction,
)

_HEADER = re.compile(r"program dev(\d+) \((\d+) instructions\)")
_LINE = re.compile(r"\s*(\d+)\s{2}(.*)")


@dataclass(frozen=True)
class Program:
    """The ordered instructions one device executes in one training iteration."""

    device: int
    instructions: tuple[Instruction, ...]

    def __str__(self) -> str:
        lines = [f"program dev{self.device} ({len(self.instructions)} instructions)"]
        lines += [f"  {i:3d}  {ins}" for i, ins in enumerate(self.instructions)]
        return "\n".join(lines)

    @classmethod
    def from_text(cls, text: str) -> Program:
        """The inverse of `str(program)`: `Program.from_text(str(p)) == p`."""
        (program,) = programs_from_text(text)
        return program


def programs_from_text(text: str) -> tuple[Program, ...]:
    """Read every program of a `programs.txt` (programs printed one after another)."""
    programs = []
    for chunk in re.split(r"(?m)^(?=program )", text):
        lines = [line for line in chunk.splitlines() if line.strip()]
        if not lines:
            continue
        header = _HEADER.fullmatch(lines[0].strip())
        if header is None:
            raise PlanError(f"not a program header: {lines[0]!r}")
        device, body = int(header[1]), list[Instruction]()
        for line in lines[1:]:
            match = _LINE.fullmatch(line)
            if match is None:
                raise PlanError(f"program dev{device}: not an instruction line: {line!r}")
            if int(match[1]) != len(body):
                raise PlanError(f"program dev{device}: instruction #{match[1]} out of order (expected #{len(body)})")
            body.append(parse_instruction(match[2]))
        programs.append(_program(device, int(header[2]), body))
    return tuple(programs)


def _program(device: int, expected: int, body: list[Instruction]) -> Program:
    if len(body) != expected:
        raise PlanError(f"program dev{device} announces {expected} instructions but lists {len(body)}")
    return Program(device, tuple(body))


def validate(programs: tuple[Program, ...]) -> None:
    """Raise a PlanError listing every problem: unknown instruction types, events that are not
    earlier instructions of the same program, sends without their receive (or the other way round,
    or to the wrong device), and all-reduces that some member device does not join as often."""
    problems: list[str] = []
    for program in programs:
        problems += _events(program) + _unpaired_halves(program)
    problems += _unmatched_messages(programs)
    problems += _unjoined_all_reduces(programs)
    if problems:
        shown = "\n  ".join(problems[:12]) + (f"\n  ... and {len(problems) - 12} more" if len(problems) > 12 else "")
        raise PlanError(f"the lowered programs are inconsistent ({len(problems)} problems):\n  {shown}")


def _events(program: Program) -> list[str]:
    problems = []
    for i, ins in enumerate(program.instructions):
        if type(ins) not in KINDS:
            problems.append(f"dev{program.device} #{i}: {type(ins).__name__} is not an instruction kind")
            continue
        problems += [f"dev{program.device} #{i} {ins}: waits for #{j}, not an earlier instruction"
                     for j in ins.waits if not 0 <= j < i]
    return problems


def _unpaired_halves(program: Program) -> list[str]:
    """A split backward's halves pair up on one device: each `WeightGrad` after the `InputGrad` of its
    stage and microbatch, once, and before that stage's update (which reads the gradient it adds)."""
    problems, open_halves = [], set()
    for i, ins in enumerate(program.instructions):
        unit = (ins.stage, getattr(ins, "microbatch", None))
        where = f"dev{program.device} #{i} {ins}"
        if isinstance(ins, InputGrad):
            if unit in open_halves:
                problems.append(f"{where}: a second input gradient before the weight gradient of the first")
            open_halves.add(unit)
        elif isinstance(ins, WeightGrad):
            if unit not in open_halves:
                problems.append(f"{where}: no input gradient of stage {ins.stage} microbatch {unit[1]} before it")
            open_halves.discard(unit)
        elif late := sorted({stage for stage, _ in open_halves} & _reads_grads_of(ins)):
            problems.append(f"{where}: reads the gradients of stage(s) {late} before their weight gradients")
    problems += [f"dev{program.device}: stage {stage} microbatch {mb}'s input gradient has no weight gradient"
                 for stage, mb in sorted(open_halves)]
    return problems


def _reads_grads_of(ins: Instruction) -> set[int]:
    """The stages whose parameter gradients an instruction reads (updates, norms, all-reduces)."""
    if isinstance(ins, ALL_REDUCES):
        return set(ins.group)
    return {ins.stage} if isinstance(ins, (Update, HostUpdate, GradNormPart)) else set()


def _unmatched_messages(programs: tuple[Program, ...]) -> list[str]:
    """Every value sent from device a to device b is received by b from a, as often."""
    sent: Counter = Counter()
    received: Counter = Counter()
    for program in programs:
        for ins in program.instructions:
            if isinstance(ins, Send):
                sent.update((key, program.device, ins.peer) for key in message_keys(ins))
            elif isinstance(ins, Recv):
                received.update((key, ins.peer, program.device) for key in message_keys(ins))
    problems = [f"dev{src} sends {key} to dev{dst}, which never receives it" for key, src, dst in sent - received]
    problems += [f"dev{dst} receives {key} from dev{src}, which never sends it" for key, src, dst in received - sent]
    return problems


def _unjoined_all_reduces(programs: tuple[Program, ...]) -> list[str]:
    """Each all-reduce runs once per member device (a device sums its member stages itself)."""
    stage_device = {ins.stage: p.device for p in programs for ins in p.instructions if not isinstance(ins, ALL_REDUCES)}
    joined: dict[tuple, Counter] = {}
    for program in programs:
        for ins in program.instructions:
            if isinstance(ins, ALL_REDUCES):
                joined.setdefault(_reduction(ins), Counter())[program.device] += 1
    problems = []
    for reduction, counts in joined.items():
        members = {stage_device[s] for s in reduction[1] if s in stage_device}
        if set(counts) != members or len(set(counts.values())) > 1:
            problems.append(f"all-reduce {reduction} over devices {sorted(members)} is joined as {dict(counts)}")
    return problems


def _reduction(ins: AllReduceShared | AllReduceGradNorm) -> tuple:
    tensors = ins.tensors if isinstance(ins, AllReduceShared) else ()
    return (type(ins).__name__, ins.group, tensors)
