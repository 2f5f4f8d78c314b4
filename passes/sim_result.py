"""The simulator's output: the predicted iteration, per-device busy time, memory, bytes and timeline."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from stagewise.ir.instructions import Instruction, Stream
from stagewise.passes.timeline import write_chrome_trace, write_png


@dataclass(frozen=True)
class Span:
    """One executed instruction: where it ran and when."""

    device: int
    stream: Stream
    index: int
    instruction: Instruction
    start: float
    end: float


@dataclass(frozen=True)
class SimResult:
    """The predicted iteration: its time, per-device busy/idle time, memory, bytes and timeline.

    `busy[d]` is the time device d's compute stream spends in compute instructions (F, B, U);
    `idle[d]` the rest of the iteration. `memory[d]` is the occupancy as (time, bytes) steps.
    """

    iteration_time: float
    busy: dict[int, float]
    idle: dict[int, float]
    peak_bytes: dict[int, float]
    p2p_bytes: dict[int, float]
    swap_in_bytes: dict[int, float]
    swap_out_bytes: dict[int, float]
    timeline: tuple[Span, ...]
    memory: dict[int, tuple[tuple[float, float], ...]]

    @property
    def bubble_fraction(self) -> float:
        """Bubble time over ideal time, t_pb / t_id (§4.2.2), with t_id the busiest device's compute."""
        ideal = max(self.busy.values())
        return (self.iteration_time - ideal) / ideal if ideal > 0 else 0.0

    def idle_fraction(self, device: int) -> float:
        """Device `device`'s idle time over its busy time: (p - 1)/m for GPipe and 1F1B on equal stages."""
        return self.idle[device] / self.busy[device] if self.busy[device] > 0 else math.inf

    def to_chrome_trace(self, path: str | Path) -> None:
        """Chrome trace JSON (loads in Perfetto / chrome://tracing): pid = device, tid = stream."""
        write_chrome_trace(self, path)

    def to_png(self, path: str | Path, width: int = 1200, row_height: int = 12) -> None:
        """A Gantt chart, one row per device stream (passes/timeline.py)."""
        write_png(self, path, width, row_height)


def span_order(span: Span) -> tuple:
    return (span.start, span.device, list(Stream).index(span.stream), span.index)


def occupancy(deltas: list[tuple[float, float]], static: float) -> tuple[tuple[float, float], ...]:
    """(time, bytes) steps; at equal times a release comes before an allocation (B ends, then F starts)."""
    steps, level = [(0.0, static)], static
    for t, delta in sorted(deltas):
        level += delta
        steps.append((t, level))
    return tuple(steps)
