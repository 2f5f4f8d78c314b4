"""Typed device instructions: one frozen dataclass per kind, the unit both interpreters execute.

A device program is a list of these. Each kind runs on one fixed stream of the device (Harmony
§4.4's five streams); `waits` lists the indices of earlier instructions on other streams of the
same device it waits for (events). Nothing here carries meaning in a string: streams, phases,
what a transfer carries and what a swap moves are enums, and every field is named.

The printed form (`str(ins)`) is one line, `<stream> <opcode> key=value ... [values] after #i,#j`,
and `parse_instruction` reads it back exactly (torch.distributed.pipelining's `_Action` does the
same for its schedules), so a saved `programs.txt` is the programs themselves.
"""

from __future__ import annotations

import dataclasses
import enum
import typing
from dataclasses import dataclass
from typing import Any, ClassVar

from stagewise.ir.errors import PlanError
from stagewise.ir.instruction_facts import Activity, Facts, Link, StashUse


class Stream(enum.Enum):
    """The five streams of a device (Harmony §4.4): one thread, or one CUDA stream, each."""

    COMPUTE = "compute"
    SWAP_IN = "swap_in"
    SWAP_OUT = "swap_out"
    P2P_IN = "p2p_in"
    P2P_OUT = "p2p_out"


class Phase(enum.Enum):
    """What a compute does with a stage: forward, recompute (Varuna §3.2), backward, update; or the
    backward split in two (zero bubble, Qi et al. §2): its input gradient, then its weight gradient."""

    FORWARD = "F"
    RECOMPUTE = "R"
    BACKWARD = "B"
    UPDATE = "U"
    INPUT_GRAD = "Bi"
    WEIGHT_GRAD = "W"

    @property
    def ends_stash(self) -> bool:
        """Whether this pass frees its microbatch's stash: a whole backward, or a split one's W."""
        return self in (Phase.BACKWARD, Phase.WEIGHT_GRAD)


class Carried(enum.Enum):
    """What a point-to-point message carries: a forward's activations or a backward's gradients."""

    ACTIVATIONS = "act"
    GRADIENTS = "grad"


class State(enum.Enum):
    """The per-stage training state a swap moves between the device pool and host memory."""

    WEIGHTS = "weights"
    GRADS = "grads"
    OPTIMIZER = "optimizer"


@dataclass(frozen=True)
class Instruction:
    """The fields every instruction has: its stage and the events it waits for. Every kind states
    its own stream, opcode and facts (ir/instruction_facts.py), or defining it raises TypeError."""

    stream: ClassVar[Stream]
    opcode: ClassVar[str]
    facts: ClassVar[Facts]
    stage: int
    waits: tuple[int, ...] = dataclasses.field(default=(), kw_only=True)

    def __init_subclass__(cls, abstract: bool = False, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        missing = [name for name in ("stream", "opcode", "facts") if name not in cls.__dict__]
        if missing and not abstract:
            raise TypeError(f"instruction kind {cls.__name__} states no {', '.join(missing)} of its own")

    def __str__(self) -> str:
        return format_instruction(self)

    @property
    def message(self) -> Carried | None:
        """What this instruction moves between stages (a send's or receive's); None for the rest."""
        return None


def microbatch_of(ins: Instruction) -> int | None:
    """The microbatch an instruction works on; None for whole-stage work (updates, state swaps)."""
    return getattr(ins, "microbatch", None)


# ---- compute stream ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Forward(Instruction):
    """A stage's forward on one microbatch; with `stash=False` it keeps only its inputs for a later
    Recompute (Varuna's recompute, Harmony's recompute)."""

    stream = Stream.COMPUTE
    opcode = "F"
    facts = Facts(Activity.FORWARD, needs_state=True, stash=StashUse.RECORDS,
                  consumes=Carried.ACTIVATIONS, makes=Carried.ACTIVATIONS)
    microbatch: int
    stash: bool = True


@dataclass(frozen=True)
class Recompute(Instruction):
    """Re-run a microbatch's forward with autograd recording, just before its backward."""

    stream = Stream.COMPUTE
    opcode = "R"
    facts = Facts(Activity.RECOMPUTE, needs_state=True, stash=StashUse.RECORDS, fence=True)
    microbatch: int


@dataclass(frozen=True)
class Backward(Instruction):
    """A stage's backward on one microbatch: gradients accumulate into the stage's parameters."""

    stream = Stream.COMPUTE
    opcode = "B"
    facts = Facts(Activity.BACKWARD, needs_state=True, stash=StashUse.READS, consumes=Carried.GRADIENTS,
                  makes=Carried.GRADIENTS)
    microbatch: int


@dataclass(frozen=True)
class InputGrad(Instruction):
    """A split backward's first half (zero bubble's B): the gradient of the stage's inputs only, sent
    on at once; the autograd graph and the stash stay for the `WeightGrad`."""

    stream = Stream.COMPUTE
    opcode = "Bi"
    facts = Facts(Activity.INPUT_GRAD, needs_state=True, stash=StashUse.READS, consumes=Carried.GRADIENTS,
                  makes=Carried.GRADIENTS)
    microbatch: int


@dataclass(frozen=True)
class WeightGrad(Instruction):
    """Its second half (W): the weights' gradient, added as a whole backward adds it; it frees the
    stash. It follows its `InputGrad` on the device (ir/program.py validates the pairing)."""

    stream = Stream.COMPUTE
    opcode = "W"
    facts = Facts(Activity.WEIGHT_GRAD, needs_state=True, stash=StashUse.READS)
    microbatch: int


@dataclass(frozen=True)
class Update(Instruction):
    """The optimizer step on the device; with `clip` it first scales the gradients by the clip
    coefficient a GradNorm all-reduce computed from norm parts counted earlier."""

    stream = Stream.COMPUTE
    opcode = "U"
    facts = Facts(Activity.UPDATE, needs_state=True, changes_state=True, fence=True, pins_forwards=True)
    clip: bool = False


@dataclass(frozen=True)
class GradNormPart(Instruction):
    """Count this stage's squared gradient norm now, while its gradients are on the device (they
    leave it before the GradNorm all-reduce that sums the parts)."""

    stream = Stream.COMPUTE
    opcode = "norm-part"
    facts = Facts(Activity.NORM_PART, needs_state=True, all_stages=True, fence=True, pins_forwards=True)


@dataclass(frozen=True)
class AllReduceShared(Instruction):
    """Sum the gradients of `tensors` (shared-tensor FQNs) over the stages of `group` (Varuna §5.2);
    a device runs it once for all its member stages, `stage` being the lowest of them."""

    stream = Stream.COMPUTE
    opcode = "allreduce-shared"
    facts = Facts(Activity.ALL_REDUCE, needs_state=True, all_stages=True, fence=True, pins_forwards=True,
                  crosses=Link.RING)
    group: tuple[int, ...]
    tensors: tuple[str, ...]


@dataclass(frozen=True)
class AllReduceGradNorm(Instruction):
    """Sum the squared gradient norm over every stage of `group` (the whole model) and clip."""

    stream = Stream.COMPUTE
    opcode = "allreduce-norm"
    facts = Facts(Activity.ALL_REDUCE, needs_state=True, all_stages=True, fence=True, pins_forwards=True,
                  crosses=Link.RING)
    group: tuple[int, ...]


# ---- point to point ---------------------------------------------------------------------------
@dataclass(frozen=True)
class _PointToPoint(Instruction, abstract=True):
    """Moves `values` of a microbatch between this stage and `peer_stage` on device `peer`."""

    microbatch: int
    carries: Carried
    peer: int
    peer_stage: int
    values: tuple[str, ...]

    @property
    def message(self) -> Carried | None:
        return self.carries


@dataclass(frozen=True)
class Send(_PointToPoint):
    """Send `values` of a microbatch to `peer_stage` on device `peer`."""

    stream = Stream.P2P_OUT
    opcode = "send"
    facts = Facts(Activity.SEND, crosses=Link.PEER)


@dataclass(frozen=True)
class Recv(_PointToPoint):
    """Receive `values` of a microbatch from `peer_stage` on device `peer`."""

    stream = Stream.P2P_IN
    opcode = "recv"
    facts = Facts(Activity.RECEIVE, crosses=Link.PEER)


# ---- swaps (Harmony §4.4) ---------------------------------------------------------------------
@dataclass(frozen=True)
class SwapIn(Instruction):
    """Bring `state` of a stage from host memory into the device pool (`nbytes` planned)."""

    stream = Stream.SWAP_IN
    opcode = "swap-in"
    facts = Facts(Activity.SWAP_IN, brings_state=True, pins_forwards=True, crosses=Link.HOST)
    state: State
    nbytes: int = 0


@dataclass(frozen=True)
class SwapOut(Instruction):
    """Write `state` of a stage back to host memory and release its device copy."""

    stream = Stream.SWAP_OUT
    opcode = "swap-out"
    facts = Facts(Activity.SWAP_OUT, evicts_state=True, changes_state=True, pins_forwards=True, crosses=Link.HOST)
    state: State
    nbytes: int = 0


@dataclass(frozen=True)
class Free(Instruction):
    """Drop the device copy of `state` whose host copy is current (unchanged weights)."""

    stream = Stream.SWAP_OUT
    opcode = "free"
    facts = Facts(Activity.SWAP_OUT, evicts_state=True, changes_state=True, pins_forwards=True)
    state: State


@dataclass(frozen=True)
class StashOut(Instruction):
    """Move the activations a microbatch's forward saved for its backward to host memory (sX)."""

    stream = Stream.SWAP_OUT
    opcode = "stash-out"
    facts = Facts(Activity.SWAP_OUT, stash=StashUse.MOVES_OUT, pins_forwards=True, crosses=Link.HOST)
    microbatch: int
    nbytes: int = 0


@dataclass(frozen=True)
class StashIn(Instruction):
    """Bring a microbatch's stash back before its backward (prefetched on the swap-in stream)."""

    stream = Stream.SWAP_IN
    opcode = "stash-in"
    facts = Facts(Activity.SWAP_IN, stash=StashUse.MOVES_IN, pins_forwards=True, crosses=Link.HOST)
    microbatch: int
    nbytes: int = 0


@dataclass(frozen=True)
class HostUpdate(Instruction):
    """The optimizer step on host master weights (Harmony's CPU update, ZeRO-Offload), on the
    swap-out stream after the gradients' copy: the device computes on meanwhile."""

    stream = Stream.SWAP_OUT
    opcode = "host-U"
    facts = Facts(Activity.UPDATE, needs_state=True, changes_state=True, fence=True, pins_forwards=True)
    clip: bool = False


KINDS: tuple[type[Instruction], ...] = (
    Forward, Recompute, Backward, InputGrad, WeightGrad, Update, GradNormPart, AllReduceShared, AllReduceGradNorm,
    Send, Recv, SwapIn, SwapOut, Free, StashOut, StashIn, HostUpdate,
)
COMPUTES = (Forward, Recompute, Backward, InputGrad, WeightGrad, Update)
ALL_REDUCES = (AllReduceShared, AllReduceGradNorm)
_BY_OPCODE: dict[str, type[Instruction]] = {kind.opcode: kind for kind in KINDS}
_SHORT = {"microbatch": "mb"}
_LONG = {short: name for name, short in _SHORT.items()}


@dataclass(frozen=True)
class MessageKey:
    """The identity of one value moving between two stages: both ends build it from their own
    instruction (a Send's stage is the source, a Recv's the destination), so they match."""

    carries: Carried
    value: str
    microbatch: int
    src_stage: int
    dst_stage: int


def message_keys(ins: Send | Recv) -> tuple[MessageKey, ...]:
    """One key per value the send or receive moves."""
    src, dst = (ins.stage, ins.peer_stage) if isinstance(ins, Send) else (ins.peer_stage, ins.stage)
    return tuple(MessageKey(ins.carries, v, ins.microbatch, src, dst) for v in ins.values)


# ---- the printed form -------------------------------------------------------------------------
def format_instruction(ins: Instruction) -> str:
    """`<stream> <opcode> key=value ... [values] after #i,#j`: every field that differs from its
    default, enums by value, tuples comma-separated; the inverse of `parse_instruction`."""
    parts = [f"{ins.stream.value:<8}", ins.opcode]
    values = ""
    for f in dataclasses.fields(ins):
        value = getattr(ins, f.name)
        if f.name == "waits" or (f.default is not dataclasses.MISSING and value == f.default):
            continue
        if f.name == "values":
            values = "[" + ", ".join(value) + "]"
        elif isinstance(value, enum.Enum):
            parts.append(value.value)
        elif isinstance(value, bool):
            parts.append(f.name if value else f"no-{f.name}")
        elif isinstance(value, tuple):
            parts.append(f"{_SHORT.get(f.name, f.name)}=" + ",".join(map(str, value)))
        else:
            parts.append(f"{_SHORT.get(f.name, f.name)}={value}")
    if values:
        parts.append(values)
    if ins.waits:
        parts.append("after " + ",".join(f"#{i}" for i in ins.waits))
    return " ".join(parts)


def parse_instruction(line: str) -> Instruction:
    """Read one instruction back from its printed form (a PlanError names a line it cannot read)."""
    head, _, waits = line.partition(" after ")
    head, _, values = head.partition(" [")
    tokens = head.split()
    if len(tokens) < 2 or tokens[1] not in _BY_OPCODE:
        raise PlanError(f"not an instruction: {line!r}")
    kind = _BY_OPCODE[tokens[1]]
    if Stream(tokens[0]) is not kind.stream:
        raise PlanError(f"{tokens[1]} runs on {kind.stream.value}, not {tokens[0]}: {line!r}")
    hints = typing.get_type_hints(kind)
    fields = {f.name for f in dataclasses.fields(kind)}
    kwargs: dict[str, Any] = {}
    for token in tokens[2:]:
        kwargs.update(_parse_token(token, kind, hints, fields, line))
    if values:
        kwargs["values"] = tuple(v for v in values.rstrip("]").split(", ") if v)
    if waits:
        kwargs["waits"] = tuple(int(w.lstrip("#")) for w in waits.split(","))
    try:
        return kind(**kwargs)
    except TypeError as error:
        raise PlanError(f"incomplete instruction {line!r}: {error}") from None


def _parse_token(token: str, kind: type[Instruction], hints: dict, fields: set[str], line: str) -> dict[str, Any]:
    if "=" in token:
        key, text = token.split("=", 1)
        name = _LONG.get(key, key)
        if name not in fields:
            raise PlanError(f"{kind.opcode} has no field {key!r}: {line!r}")
        hint = hints[name]
        if hint == tuple[int, ...]:
            return {name: tuple(int(x) for x in text.split(",") if x)}
        if hint == tuple[str, ...]:
            return {name: tuple(x for x in text.split(",") if x)}
        return {name: int(text)}
    for name in fields:
        hint = hints[name]
        if isinstance(hint, type) and issubclass(hint, enum.Enum) and token in {e.value for e in hint}:
            return {name: hint(token)}
        if hint is bool and token in (name, f"no-{name}"):
            return {name: token == name}
    raise PlanError(f"{kind.opcode} does not take {token!r}: {line!r}")
