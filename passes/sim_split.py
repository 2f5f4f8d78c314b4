"""The simulated iteration split into compute, bubble and exposed swap, p2p and all-reduce time.

Why: the plan table says where the time goes (ir/time_split.py) from the same timeline the
iteration time comes from, so its parts sum to it. On each device the iteration [0, T] is cut by
what runs: compute first, then all-reduces (both on the compute stream), then the host optimizer's
steps and host copies on the swap streams, then messages on the p2p streams; a moment counts for the first of these running
then, so a copy that overlaps compute is hidden and counts nowhere, and a moment with none
running is bubble. The device reported is the one with the least bubble: the others wait on it.
"""

from __future__ import annotations

from collections.abc import Iterable

from stagewise.ir.instructions import ALL_REDUCES, HostUpdate, Stream
from stagewise.ir.time_split import Bound, TimeSplit
from stagewise.passes.sim_result import SimResult, Span

_SWAP_STREAMS = (Stream.SWAP_IN, Stream.SWAP_OUT)  # swaps, stashes and the host optimizer step
_P2P_STREAMS = (Stream.P2P_IN, Stream.P2P_OUT)


def time_split(result: SimResult) -> TimeSplit:
    """The split of the device with the least bubble (the lowest such device on a tie)."""
    return min(device_splits(result).values(), key=lambda split: (split.bubble_s, split.device))


def device_splits(result: SimResult) -> dict[int, TimeSplit]:
    """Every device's split of `result.iteration_time` (module docstring)."""
    return {device: _split(device, [s for s in result.timeline if s.device == device], result.iteration_time)
            for device in sorted(result.busy)}


def _split(device: int, spans: list[Span], total: float) -> TimeSplit:
    compute = [s for s in spans if s.stream is Stream.COMPUTE and not isinstance(s.instruction, ALL_REDUCES)]
    allreduce = [s for s in spans if isinstance(s.instruction, ALL_REDUCES)]
    host_steps = [s for s in spans if s.stream in _SWAP_STREAMS and isinstance(s.instruction, HostUpdate)]
    copies = [s for s in spans if s.stream in _SWAP_STREAMS and not isinstance(s.instruction, HostUpdate)]
    p2p = [s for s in spans if s.stream in _P2P_STREAMS]
    covered = [0.0]  # the time covered by the first k kinds, k = 0 .. 5
    upto: list[Span] = []
    for kind in (compute, allreduce, host_steps, copies, p2p):
        upto += kind
        covered.append(max(covered[-1], _union_length(upto)))
    compute_s, allreduce_s, host_step_s, copies_s, p2p_s = (covered[k + 1] - covered[k] for k in range(5))
    bubble_s = max(total - covered[-1], 0.0)
    return TimeSplit(device, compute_s, bubble_s, host_step_s + copies_s, p2p_s, allreduce_s,
                     bound_of(compute_s, copies_s, p2p_s + allreduce_s, host_step_s))


def bound_of(compute_s: float, host_link_s: float, between_devices_s: float, host_step_s: float = 0.0) -> Bound:
    """The largest of compute, exposed host-link time, exposed time on the links between devices and
    the exposed host optimizer step (compute on a tie): the bubble is the schedule's, not a resource's.
    The host step runs on a swap stream, but what makes it faster is the host, not the link."""
    return max(((compute_s, Bound.COMPUTE), (host_link_s, Bound.PCIE), (between_devices_s, Bound.NETWORK),
                (host_step_s, Bound.HOST_OPTIMIZER)), key=lambda pair: pair[0])[1]


def _union_length(spans: Iterable[Span]) -> float:
    """The time at least one of `spans` runs."""
    length, reach = 0.0, float("-inf")
    for start, end in sorted((s.start, s.end) for s in spans):
        if end > reach:
            length += end - max(start, reach)
            reach = end
    return length
