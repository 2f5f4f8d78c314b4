"""Human-readable views of a plan: the stage table and the shared tensors."""

from __future__ import annotations

import io

from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from stagewise.ir.devices import format_bytes
from stagewise.ir.instructions import COMPUTES, WeightGrad, microbatch_of

_ORDER_SHOWN = 24  # compute instructions shown per device where backwards are split


def render_plan(plan) -> str:
    """The plan as text (print(plan)): its tables at a fixed width, and the predictions."""
    return "\n".join(part if isinstance(part, str) else _render(part) for part in plan_parts(plan))


def plan_group(plan) -> Group:
    """The same for rich's console.print, laid out at the console's width."""
    return Group(*(Text(part) if isinstance(part, str) else part for part in plan_parts(plan)))


def plan_parts(plan) -> list[Table | str]:
    """The stage table, the predictions, the plans considered and the shared tensors."""
    schedule = f"{plan.schedule}" + (" ASYNCHRONOUS: one-step-stale updates, two weight versions"
                                     if plan.schedule.asynchronous else "")
    stages = Table(title=f"stagewise plan: {plan.model} ({plan.tracer} trace, {schedule}, "
                   f"{plan.microbatches} microbatches of {plan.microbatch_size})")
    for column in ("stage", "device", "layers", "params", "activations", "fwd GFLOP/mb", "pred F+B ms/mb", "receives", "sends"):
        stages.add_column(column)
    for stage in plan.stages:
        predicted = plan.predicted_stage_s[stage.index] * 1e3 if plan.predicted_stage_s else None
        layers = [plan.layers[i] for i in stage.layers]
        names = layers[0].name if len(layers) == 1 else f"{layers[0].name} .. {layers[-1].name} ({len(layers)})"
        params = sum(layer.param_bytes for layer in layers)
        flops = sum(layer.flops for layer in layers) / 1e9
        receives = [t for t in plan.transfers if t.dst == stage.index]
        sends = [t for t in plan.transfers if t.src == stage.index]
        stages.add_row(
            str(stage.index),
            f"{stage.device}: {plan.devices[stage.device].name}",
            names,
            format_bytes(params),
            str(stage.activations),
            f"{flops:.4f}",
            "-" if predicted is None else f"{predicted:.3f}",
            _transfers(receives, plan.microbatch_size, "src"),
            _transfers(sends, plan.microbatch_size, "dst"),
        )
    parts: list[Table | str] = [stages]
    idle = sorted(set(range(len(plan.devices))) - {stage.device for stage in plan.stages})
    if idle:
        parts.append(f"idle devices: {', '.join(map(str, idle))} (the plan runs fewer stages than there are devices)")
    if plan.predicted_iteration_s is not None:
        peaks = ", ".join(f"dev{d} {format_bytes(b)}" for d, b in enumerate(plan.predicted_peak_bytes))
        parts.append(f"predicted ({plan.cost_model} costs): {plan.predicted_iteration_s * 1e3:.2f} ms per iteration; "
                     f"peak memory {peaks}")
    if plan.predicted_split is not None:
        split = plan.predicted_split
        parts.append(f"where the time goes (dev{split.device}, the busiest): {split}")
    if any(isinstance(ins, WeightGrad) for program in plan.programs for ins in program.instructions):
        parts.append(_split_order(plan))
    if plan.precision != "fp32":
        parts.append(f"precision: {plan.precision} (forwards under torch.autocast; fp32 weights, gradients, optimizer)")
    if plan.tensor_parallel is not None:
        parts.append(plan.tensor_parallel.describe(tuple(layer.name for layer in plan.layers), len(plan.devices)))
    if plan.considered:
        parts.append("plans considered:\n  " + "\n  ".join(plan.considered))
    if plan.shared:
        shared = Table(title="shared tensors (replicated; gradients summed before each update, unless frozen)")
        for column in ("tensor", "also named", "stages", "kind"):
            shared.add_column(column)
        for tensor in plan.shared:
            frozen = tensor.kind != "buffer" and not tensor.trainable
            kind = f"{tensor.kind}, frozen" if frozen else tensor.kind
            shared.add_row(tensor.fqn, ", ".join(tensor.names[1:]) or "-", ",".join(map(str, tensor.stages)), kind)
        parts.append(shared)
    return parts


def _split_order(plan) -> str:
    """Where backwards are split (zero bubble): each device's compute order, B (`Bi`) and W apart; on a
    device that runs several stages (ZB-V's two chunks) each pass names its stage (`F0@s3`)."""
    lines = ["backwards split into input gradient (Bi) and weight gradient (W); compute order per device:"]
    for program in plan.programs:
        computes = [ins for ins in program.instructions if isinstance(ins, COMPUTES)]
        several = len({ins.stage for ins in computes}) > 1
        order = [(ins.opcode if (mb := microbatch_of(ins)) is None else f"{ins.opcode}{mb}")
                 + (f"@s{ins.stage}" if several else "") for ins in computes]
        more = " ..." if len(order) > _ORDER_SHOWN else ""
        lines.append(f"  dev{program.device}: {' '.join(order[:_ORDER_SHOWN])}{more}")
    return "\n".join(lines)


def _transfers(transfers, microbatch_size: int, side: str) -> str:
    if not transfers:
        return "-"
    return "\n".join(
        f"{t.value} {'<-' if side == 'src' else '->'} {getattr(t, side)} ({format_bytes(t.bytes_per_sample * microbatch_size)})"
        for t in transfers
    )


def _render(table: Table) -> str:
    buffer = io.StringIO()
    Console(file=buffer, width=140, force_terminal=False, color_system=None).print(table)
    return buffer.getvalue().rstrip()
