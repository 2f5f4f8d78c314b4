"""Where one device's time went in the last step: `DeviceTime`, derived from the step's clocks.

The split is of the device's compute thread, the thread that runs the stage code: in a step of
`step_s` seconds (from the launch to the return of the step's last stream thread in this
process) it computed (`compute_s`), was blocked on a dependency (`waiting_s`), ran swap and p2p
instructions itself (`inline_s`: threadless streams), did the runtime's own work (`dispatch_s`) or had
returned already (`idle_s`), and these add up to `step_s`. Dispatch is what the runtime costs
beyond the model; waiting is the pipeline's bubble and the partners' delays; compute is the
model. The swap and p2p streams run on threads of their own (or, threadless, on whichever thread
made them ready) beside the compute, so their seconds are also given apart, per stream.

All are host seconds. On a CUDA device an instruction's seconds are those its thread spent
issuing it (and any synchronization it makes), not the GPU's.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, fields

from stagewise.ir.instructions import Stream
from stagewise.ir.program import Program
from stagewise.runtime.step_timing import StepTimes, ThreadClock


@dataclass(frozen=True)
class DeviceTime(Mapping[str, float]):
    """One device's last step, in seconds (`pipe.time_breakdown()`): compute_s + waiting_s +
    dispatch_s + inline_s + idle_s == step_s. Compute well above dispatch: the model is the
    cost; dispatch near compute: the runtime is. Also readable by field name (`row["compute_s"]`,
    `dict(row)`), as the dicts `time_breakdown` returned before were.

    Args:
        device: the device's index in the plan.
        step_s: the step's wall time in this process, from its launch to its last stream thread's return.
        compute_s: the stage code: the compute stream's instructions, net of the waits inside them.
        waiting_s: the compute thread blocked on a dependency (an event, a message, an all-reduce partner).
        dispatch_s: the runtime's own work on the compute thread: the rest of its time from the step's
            launch (handing the thread its job included) until it returned.
        inline_s: swap and p2p instructions the compute thread ran itself (threadless streams,
            runtime/threadless.py; receives Varuna's policy took over), also counted in their streams' seconds.
        idle_s: after the compute thread returned, until the step's last thread did.
        swap_in_s: the swap_in stream's instructions, net of waits, wherever they ran.
        swap_out_s: the swap_out stream's.
        p2p_in_s: the p2p_in stream's, wherever they ran; a receive's wait for its message is not counted.
        p2p_out_s: the p2p_out stream's.

    Example:
        >>> _ = pipe.step(x, target=y)
        >>> row = pipe.time_breakdown()[1]
        >>> isinstance(row, sw.DeviceTime), row.device, row.compute_s > 0, row["waiting_s"] >= 0
        (True, 1, True, True)
    """

    device: int
    step_s: float
    compute_s: float
    waiting_s: float
    dispatch_s: float
    inline_s: float
    idle_s: float
    swap_in_s: float
    swap_out_s: float
    p2p_in_s: float
    p2p_out_s: float

    @property
    def swap_s(self) -> float:
        """Seconds of swapping in and out (they overlap each other and the compute).

        Example:
            >>> pipe.time_breakdown()[0].swap_s  # the MLP's plan swaps nothing
            0.0
        """
        return self.swap_in_s + self.swap_out_s

    @property
    def p2p_s(self) -> float:
        """Seconds of sending and receiving, net of waits for a message (they overlap the compute).

        Example:
            >>> _ = pipe.step(x, target=y)
            >>> pipe.time_breakdown()[0].p2p_s > 0  # device 0 sends activations, receives gradients
            True
        """
        return self.p2p_in_s + self.p2p_out_s

    def __getitem__(self, name: str) -> float:
        if name not in _NAMES:
            raise KeyError(name)
        return getattr(self, name)

    def __iter__(self) -> Iterator[str]:
        return iter(_NAMES)

    def __len__(self) -> int:
        return len(_NAMES)


_NAMES = tuple(f.name for f in fields(DeviceTime))
TIME_COLUMNS = _NAMES[1:]  # what `pipe.stats` rows add (their `device` is the pool's)


def device_times(programs: tuple[Program, ...], times: StepTimes) -> list[DeviceTime]:
    """Each program's device in the step `times` recorded (all zero before the first step)."""
    end = times.ended_at()
    compute_threads = {clock.device: clock for clock in times.threads if clock.stream is Stream.COMPUTE}
    return [_device_time(program, times, compute_threads.get(program.device), end) for program in programs]


def _device_time(program: Program, times: StepTimes, clock: ThreadClock | None, end: float) -> DeviceTime:
    net = times.net.get(program.device, [])
    busy = dict.fromkeys(Stream, 0.0)
    for ins, seconds in zip(program.instructions, net, strict=False):
        busy[ins.stream] += seconds
    streams = {f"{stream.value}_s": busy[stream] for stream in (Stream.SWAP_IN, Stream.SWAP_OUT,
                                                                 Stream.P2P_IN, Stream.P2P_OUT)}
    step_s = end - times.started_at
    if clock is None:  # no compute instruction on this device (or no step yet): it idled
        return DeviceTime(program.device, step_s, 0.0, 0.0, 0.0, 0.0, step_s, **streams)
    returned = end if clock.ended is None else clock.ended
    dispatch = (returned - times.started_at) - clock.own_s - clock.waited_s - clock.other_s
    return DeviceTime(program.device, step_s, clock.own_s, clock.waited_s, dispatch, clock.other_s,
                      end - returned, **streams)


def stats_columns(time: DeviceTime | None) -> dict[str, float | None]:
    """A `pipe.stats` row's time columns: the device's last step, or None where another process runs it."""
    return {name: None if time is None else time[name] for name in TIME_COLUMNS}
