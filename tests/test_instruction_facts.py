"""Each instruction kind states its facts (ir/instruction_facts.py), and what reads them (events,
Varuna's deviation points, the simulator's cost, the timeline) needs nothing else of the kind."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from stagewise.ir.instruction_facts import Activity, Facts
from stagewise.ir.instructions import KINDS, Instruction, Send, Stream, parse_instruction
from stagewise.ir.program import Program
from stagewise.passes.events import with_events
from stagewise.passes.sim_cost import SimCost
from stagewise.passes.timeline import STYLE, label


@pytest.mark.parametrize("kind", KINDS, ids=lambda kind: kind.__name__)
def test_every_kind_states_its_own_facts(kind: type[Instruction]) -> None:
    assert isinstance(kind.__dict__.get("facts"), Facts)
    assert {"stream", "opcode"} <= set(kind.__dict__)


def test_a_kind_without_facts_cannot_be_defined() -> None:
    """As an interpreter that handles no such kind: the omission fails where the kind is defined."""
    with pytest.raises(TypeError, match="Dummy states no facts"):

        @dataclass(frozen=True)
        class Dummy(Instruction):
            stream = Stream.COMPUTE
            opcode = "dummy"

    with pytest.raises(TypeError, match="LoudSend states no stream, opcode, facts"):

        @dataclass(frozen=True)
        class LoudSend(Send):  # a kind does not inherit another's facts
            pass

    @dataclass(frozen=True)
    class Stated(Instruction):
        stream = Stream.COMPUTE
        opcode = "stated"
        facts = Facts(Activity.UPDATE)

    assert Stated(0).facts.activity is Activity.UPDATE


def test_every_activity_is_drawn() -> None:
    assert set(STYLE) == set(Activity)


def _program(*lines: str) -> Program:
    return Program(device=0, instructions=tuple(parse_instruction(line) for line in lines))


def test_events_of_stash_swaps_and_a_host_update() -> None:
    """The rules of docs/architecture.md ("Events") on the kinds the golden programs lack."""
    program = with_events(_program(
        "p2p_in   recv stage=1 mb=0 act peer=0 peer_stage=0 [x]",  # 0
        "swap_in  swap-in stage=1 weights nbytes=8",  # 1
        "compute  F stage=1 mb=0",  # 2
        "p2p_out  send stage=1 mb=0 act peer=2 peer_stage=2 [y]",  # 3
        "swap_out stash-out stage=1 mb=0 nbytes=4",  # 4
        "p2p_in   recv stage=1 mb=0 grad peer=2 peer_stage=2 [y]",  # 5
        "swap_in  stash-in stage=1 mb=0 nbytes=4",  # 6
        "compute  B stage=1 mb=0",  # 7
        "p2p_out  send stage=1 mb=0 grad peer=0 peer_stage=0 [x]",  # 8
        "swap_out swap-out stage=1 grads nbytes=8",  # 9
        "swap_out host-U stage=1",  # 10
        "swap_in  swap-in stage=1 weights nbytes=8",  # 11
    ))
    assert [ins.waits for ins in program.instructions] == [
        (), (), (0, 1), (2,),
        (2, 3),  # the stash leaves after its forward and the send that read its outputs
        (), (4,),  # and comes back once it is out
        (5, 6),  # the backward after its gradient and its stash (the weights' swap-in is earlier on that stream)
        (7,), (1, 7),
        (1, 5, 7, 8),  # the host update after everything on other streams but the stash's swap-in
        (10,),  # the weights come back after the host update changed their master
    ]


def test_deviation_barriers_are_the_kinds_that_pin_forwards() -> None:
    from stagewise.ir.deviations import DeviationPoints

    program = _program("compute  F stage=0 mb=0", "swap_in  stash-in stage=0 mb=0", "compute  R stage=0 mb=0",
                       "compute  U stage=0", "compute  F stage=0 mb=1")
    assert DeviationPoints(program).barriers == [0, 0, 1, 1, 2]


@pytest.mark.parametrize(("line", "seconds"), [
    ("compute  F stage=1 mb=0", 2.0), ("compute  R stage=1 mb=0", 2.0), ("compute  B stage=1 mb=0", 4.0),
    ("compute  U stage=1", 6.0), ("swap_out host-U stage=1", 6.0),
])
def test_compute_seconds_by_activity(line: str, seconds: float) -> None:
    cost = SimCost((1.0, 2.0), (3.0, 4.0), update_s=(5.0, 6.0))
    assert cost.compute_s(parse_instruction(line)) == seconds


@pytest.mark.parametrize(("line", "text", "legend"), [
    ("compute  R stage=1 mb=3", "R3", "recompute"), ("compute  U stage=1", "U", "update"),
    ("swap_out host-U stage=1 clip", "host-U stage=1 clip", "update"),
    ("p2p_in   recv stage=1 mb=2 grad peer=2 peer_stage=2 [y]", "recv grad mb2 <- dev2", "receive"),
    ("compute  norm-part stage=0", "norm-part stage=0", "all-reduce"),
    ("swap_in  stash-in stage=0 mb=1 nbytes=4", "stash-in stage=0 mb=1 nbytes=4", "swap in"),
])
def test_timeline_label_and_legend(line: str, text: str, legend: str) -> None:
    ins = parse_instruction(line)
    assert label(ins) == text
    assert STYLE[ins.facts.activity][0] == legend
