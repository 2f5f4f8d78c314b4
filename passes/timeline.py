"""Pictures of a simulated (or measured) iteration: a Chrome trace and a Gantt chart.

The Chrome trace (Trace Event Format) opens in Perfetto: pid = device, tid = stream, memory as a
counter. The Gantt chart is drawn with matplotlib (the optional `plot` extra): one row per device
stream, labelled, a time axis in milliseconds and a legend of the instruction kinds.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from stagewise.ir.errors import StagewiseError
from stagewise.ir.instruction_facts import Activity
from stagewise.ir.instructions import Instruction, Recv, Send, Stream, microbatch_of

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from stagewise.passes.simulate import SimResult

_STREAMS = list(Stream)

# (legend label, colour) per activity: a norm part is drawn with the all-reduce it feeds, every
# swap (state or stash) with its direction
STYLE: dict[Activity, tuple[str, str]] = {
    Activity.FORWARD: ("forward", "#4285f4"),
    Activity.RECOMPUTE: ("recompute", "#8ab4f8"),
    Activity.BACKWARD: ("backward", "#34a853"),
    Activity.INPUT_GRAD: ("input gradient (B)", "#34a853"),
    Activity.WEIGHT_GRAD: ("weight gradient (W)", "#81c995"),
    Activity.UPDATE: ("update", "#fb8c00"),
    Activity.SEND: ("send", "#ab47bc"),
    Activity.RECEIVE: ("receive", "#e91e63"),
    Activity.ALL_REDUCE: ("all-reduce", "#fdd835"),
    Activity.NORM_PART: ("all-reduce", "#fdd835"),
    Activity.SWAP_IN: ("swap in", "#00acc1"),
    Activity.SWAP_OUT: ("swap out", "#00897b"),
}
_PHASES = (Activity.FORWARD, Activity.RECOMPUTE, Activity.BACKWARD, Activity.INPUT_GRAD, Activity.WEIGHT_GRAD,
           Activity.UPDATE)


def _style(ins: Instruction) -> tuple[str, str]:
    return STYLE[ins.facts.activity]


def label(ins: Instruction) -> str:
    """A short name for a timeline bar: `F3`, `send act mb3 -> dev2`, `swap-in weights`; a compute
    stream's forward, recompute, backward or update is its opcode and microbatch."""
    microbatch = microbatch_of(ins)
    if ins.stream is Stream.COMPUTE and ins.facts.activity in _PHASES:
        return ins.opcode if microbatch is None else f"{ins.opcode}{microbatch}"
    if isinstance(ins, (Send, Recv)):
        arrow = "->" if ins.facts.activity is Activity.SEND else "<-"
        return f"{ins.opcode} {ins.carries.value} mb{ins.microbatch} {arrow} dev{ins.peer}"
    return str(ins).split(" after ")[0].split(maxsplit=1)[1]


def chrome_trace(result: SimResult) -> dict[str, Any]:
    """Trace Event Format: one complete ("X") event per instruction, memory as counter ("C") events."""
    events: list[dict[str, Any]] = []
    for d in result.busy:
        events.append({"ph": "M", "name": "process_name", "pid": d, "args": {"name": f"dev{d}"}})
        events += [{"ph": "M", "name": "thread_name", "pid": d, "tid": t, "args": {"name": s.value}}
                   for t, s in enumerate(_STREAMS)]
    for span in result.timeline:
        ins = span.instruction
        events.append({
            "ph": "X", "name": label(ins), "cat": type(ins).__name__, "pid": span.device,
            "tid": _STREAMS.index(span.stream), "ts": span.start * 1e6, "dur": (span.end - span.start) * 1e6,
            "args": {"instruction": str(ins), "index": span.index, "stage": ins.stage,
                     "microbatch": microbatch_of(ins)},
        })
    for d, steps in result.memory.items():
        events += [{"ph": "C", "name": "memory", "pid": d, "ts": t * 1e6, "args": {"bytes": b}} for t, b in steps]
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_chrome_trace(result: SimResult, path: str | Path) -> None:
    Path(path).write_text(json.dumps(chrome_trace(result)))


def gantt_figure(result: SimResult, width: int = 1200, row_height: int = 12) -> Figure:
    """One labelled row per (device, stream) that ran something, a bar per instruction, time in ms."""
    try:
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch
    except ImportError as error:  # an optional extra
        raise StagewiseError("drawing a timeline needs matplotlib: pip install 'stagewise[plot]'") from error
    used = sorted({(s.device, _STREAMS.index(s.stream)) for s in result.timeline})
    rows = {key: i for i, key in enumerate(used)}
    dpi = 100
    figure = Figure(figsize=(width / dpi, max(2.0, (len(rows) * row_height + 60) / dpi)), dpi=dpi)
    axes = figure.add_subplot()
    legend: dict[str, str] = {}
    for span in result.timeline:
        name, colour = _style(span.instruction)
        legend[name] = colour
        row = rows[(span.device, _STREAMS.index(span.stream))]
        axes.barh(row, (span.end - span.start) * 1e3, left=span.start * 1e3, height=0.8, color=colour,
                  edgecolor="white", linewidth=0.3)
    axes.set_yticks(range(len(rows)), [f"dev{d} {_STREAMS[s].value}" for d, s in used])
    axes.invert_yaxis()
    axes.set_xlim(0, result.iteration_time * 1e3)
    axes.set_xlabel("time (ms)")
    axes.legend(handles=[Patch(color=c, label=n) for n, c in legend.items()], loc="upper left",
                bbox_to_anchor=(1.0, 1.0), fontsize="small")
    figure.tight_layout()
    return figure


def write_png(result: SimResult, path: str | Path, width: int = 1200, row_height: int = 12) -> None:
    gantt_figure(result, width, row_height).savefig(path, format="png")
