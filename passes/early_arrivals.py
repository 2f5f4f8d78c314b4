"""The most memory a device can hold when the messages it receives arrive as early as they can.

A message fills a transfer buffer on its receiver from its arrival (the in-process mailbox; a
posted receive under torch.distributed) until the receiver's backward of that microbatch, so how
many buffers a device holds at once depends on how far its senders run ahead of it: one timing,
the simulator's, is not all the timings the runtime meets. Seen on a 2-device 1F1B: device 0 still
in its first backward while device 1 had sent the second microbatch's gradient, one buffer more
than the simulated peak, which on a device planned to its limit is a `CapacityError` mid-step.

The worst case for a device is the timing in which it computes slowly and every other device
fast: each message to it then arrives as soon as the work it depends on allows, including the
device's own earlier sends. The planner simulates that timing for each device whose memory is
bounded and charges the larger peak (a device without a limit keeps the nominal one: nothing is
decided by it, and it costs one simulation less).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace

from stagewise.ir.devices import DeviceSpec
from stagewise.ir.instructions import Recv
from stagewise.ir.program import Program
from stagewise.passes.sim_cost import SimCost
from stagewise.passes.simulate import simulate

SLOWED = 1e3  # the device's computes take this much longer: the others' work and the links become instants


def early_arrival_peaks(programs: Sequence[Program], cost: SimCost, devices: Sequence[DeviceSpec],
                        simulated: Mapping[int, float]) -> tuple[int, ...]:
    """Per device, the larger of its `simulated` peak and its peak when its messages arrive as early
    as they can: for each device with a memory limit that receives messages and fits nominally (one
    that does not fit is out already)."""
    worst = [int(simulated.get(d, 0)) for d in range(len(devices))]
    for program in programs:  # one per device: its entry is still the simulated peak here
        device = program.device
        limit = devices[device].memory
        if limit is None or worst[device] > limit or not _receives(program):
            continue
        slowed = simulate(programs, replace(cost, slowed={device: SLOWED}))
        worst[device] = max(worst[device], int(slowed.peak_bytes.get(device, 0)))
    return tuple(worst)


def _receives(program: Program) -> bool:
    """Whether `program` receives anything: without messages its peak does not depend on timing this way."""
    return any(isinstance(ins, Recv) for ins in program.instructions)
