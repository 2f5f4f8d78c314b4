"""What each instruction kind reads, writes and waits for, stated once per kind.

The events (passes/events.py), Varuna's deviation points (ir/deviations.py), the simulator's
cost (passes/sim_cost.py) and the timeline (passes/timeline.py) all ask the same questions of an
instruction: what it does, which stage state and which stash it uses, which messages it needs and
makes. Each kind in ir/instructions.py answers them in one `Facts`, and defining a kind without
its own facts raises `TypeError` (as an interpreter that handles no such kind does), so a new kind
cannot be treated as "none of the above" by one of them.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # instructions.py imports this module to state each kind's facts
    from stagewise.ir.instructions import Carried


class Activity(enum.Enum):
    """What an instruction does, as the timeline draws it and the simulator charges it."""

    FORWARD = "forward"
    RECOMPUTE = "recompute"
    BACKWARD = "backward"
    INPUT_GRAD = "input gradient"  # a split backward's first half (zero bubble's B)
    WEIGHT_GRAD = "weight gradient"  # its second half (zero bubble's W)
    UPDATE = "update"
    NORM_PART = "norm part"
    ALL_REDUCE = "all-reduce"
    SEND = "send"
    RECEIVE = "receive"
    SWAP_IN = "swap in"
    SWAP_OUT = "swap out"


class Link(enum.Enum):
    """The link an instruction's bytes cross, which the simulator charges them at."""

    HOST = "host link"  # the device's link to its host's memory (PCIe), shared by the devices of that host
    PEER = "peer link"  # the link between the device and its peer
    RING = "ring"  # the links of a ring over the group's devices (the slowest bounds it)


class StashUse(enum.Enum):
    """An instruction's part in a microbatch's stash, the activations kept from forward to backward."""

    RECORDS = "records"  # a forward or recompute makes it
    MOVES_OUT = "moves out"  # to host memory, once recorded and read by the sends
    MOVES_IN = "moves in"  # back from host memory, once moved out
    READS = "reads"  # the backward uses it (after its move in)


@dataclass(frozen=True)
class Facts:
    """One kind's dependencies; a fact left out is one the kind does not have.

    `needs_state`: its stage's training state must be on the device (it waits for the stage's
    swap-ins); `all_stages`: every stage's (it waits for every swap-in before it).
    `brings_state` / `evicts_state`: it moves stage state into / out of the device.
    `changes_state`: a later swap-in of its stage must wait for it (it evicted or updated the state).
    `stash`: its part in its microbatch's stash. `consumes`: the messages of its stage and
    microbatch it needs to have arrived; `makes`: what the sends of its stage and microbatch carry.
    `fence`: it waits for everything before it on the other streams (stash swaps, and other
    stages' swap-ins where it needs only its own stage's state, excepted).
    `pins_forwards`: Varuna's opportunistic policy never runs a forward early past it.
    `crosses`: the link its bytes cross; None for a kind that moves no bytes between memories.
    """

    activity: Activity
    needs_state: bool = False
    all_stages: bool = False
    brings_state: bool = False
    evicts_state: bool = False
    changes_state: bool = False
    stash: StashUse | None = None
    consumes: Carried | None = None
    makes: Carried | None = None
    fence: bool = False
    pins_forwards: bool = False
    crosses: Link | None = None
