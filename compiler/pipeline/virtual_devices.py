"""Virtual devices (VirtualFlow): a plan for V devices, whatever number of physical ones run it.

`compile(model, devices, ..., virtual_devices=V)` plans for V virtual devices and places them on
the physical `devices`, each physical device taking a number of them in proportion to its
`speed` (VirtualFlow §6, heterogeneous devices), every virtual device a share of its physical
device's memory and compute. The plan, and so the order of every reduction (a tied weight's
gradient across stages, the replicas' all-reduce, the clipping norm), is the virtual plan's:
training is bitwise the same on 1, 2 or 4 physical devices, where plans made for each count
would sum in different orders. `pipe.resize(devices)` re-maps the same virtual devices onto
other physical ones between steps, without tracing or planning again.

Under torch.distributed a process runs one device of the plan (T processes with
tensor_parallel=T), so there V is the world size / T;
a job that loses ranks goes on from a checkpoint (`pipe.restore`, compiler/pipeline/morph.py).
"""

from __future__ import annotations

import tempfile
import warnings
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from stagewise.compiler.assembly.fx_sources import releasing_fx_sources
from stagewise.compiler.checkpoint.read import read_checkpoint, trusted_by_name
from stagewise.compiler.checkpoint.reopen import reopen
from stagewise.compiler.checkpoint.verify import rebuild_checkpoint
from stagewise.ir.devices import Device, resolve_devices
from stagewise.ir.errors import CapacityError, IdleDevicesWarning, OptionError
from stagewise.ir.plan import Plan
from stagewise.runtime.launch import distributed_context

if TYPE_CHECKING:
    from stagewise.compiler.pipeline.pipeline import Pipeline


def virtual_layout(devices, virtual: int | None, tensor_parallel: int = 1) -> list[Device]:
    """The devices to plan for: `devices` themselves, or `virtual` devices placed on them; under
    torch.distributed `tensor_parallel` ranks run each of them (`RankLayout`)."""
    physical = resolve_devices(devices)
    if virtual is None:
        return physical
    if isinstance(virtual, bool) or not isinstance(virtual, int) or virtual < len(physical):
        raise OptionError(f"virtual_devices={virtual!r} must be an int of at least the {len(physical)} physical "
                          "devices given: each physical device runs one or more virtual devices")
    context = distributed_context()
    if context is not None and virtual * tensor_parallel != context.world_size:
        raise OptionError(f"virtual_devices={virtual} under torch.distributed with {context.world_size} processes "
                          f"and tensor_parallel={tensor_parallel}: each {tensor_parallel} process(es) run one device "
                          f"of the plan, so give virtual_devices equal to the world size / {tensor_parallel}; to go "
                          "on with fewer processes, restore a checkpoint (pipe.restore)")
    owners = _owners(physical, virtual)
    return [_share(physical[owner], owners.count(owner)) for owner in owners]


def _owners(physical: list[Device], virtual: int) -> list[int]:
    """The physical device of each of `virtual` devices: runs of each, in proportion to speed."""
    counts = virtual_counts([d.speed for d in physical], virtual)
    return [index for index, count in enumerate(counts) for _ in range(count)]


def virtual_counts(speeds: list[float], virtual: int) -> list[int]:
    """Virtual devices per physical device, in proportion to speed (largest remainder), at least one each."""
    total = sum(speeds)
    exact = [virtual * s / total for s in speeds]
    counts = [max(1, int(e)) for e in exact]
    while sum(counts) > virtual:
        counts[max(range(len(counts)), key=lambda i: (counts[i] - exact[i], counts[i]))] -= 1
    while sum(counts) < virtual:
        counts[max(range(len(counts)), key=lambda i: exact[i] - counts[i])] += 1
    return counts


def _share(device: Device, count: int) -> Device:
    """One of `count` virtual devices on `device`: its share of the memory and of the speed."""
    memory = None if device.memory is None else int(device.memory) // count
    flops = None if device.peak_flops is None else float(device.peak_flops) / count
    return replace(device, memory=memory, speed=device.speed / count, peak_flops=flops)


def remapped(plan: Plan, devices, call: str = "sw.load(directory, devices=..., replan=False)") -> Plan:
    """`plan` with its devices placed on the physical `devices` (as `virtual_layout` places them);
    CapacityError where a physical device cannot hold the predicted peaks of the ones it takes, and
    IdleDevicesWarning where devices are left over (`call` is what the warning names)."""
    physical = resolve_devices(devices)
    if len(physical) > len(plan.devices):
        warnings.warn(IdleDevicesWarning(
            f"{call}: the plan has {len(plan.devices)} devices, so {len(physical) - len(plan.devices)} of the "
            f"{len(physical)} given stay idle; to use them all, plan for them: sw.load(directory, devices=..., "
            "replan=True), or compile with virtual_devices= at least their number"), stacklevel=3)
    owners = _owners(physical, len(plan.devices))
    for index, device in enumerate(physical):
        mine = [v for v, owner in enumerate(owners) if owner == index]
        need = sum(plan.predicted_peak_bytes[v] for v in mine) if plan.predicted_peak_bytes else 0
        if device.memory is not None and need > int(device.memory):
            raise CapacityError(f"{device.name} would run virtual devices {mine}, whose predicted peaks add up to "
                                f"{need} bytes, over its {device.memory}: give more physical devices")
    specs = tuple(replace(plan.devices[v], name=str(physical[owners[v]].name)) for v in range(len(plan.devices)))
    return replace(plan, devices=specs)


@releasing_fx_sources
def resize(pipe: Pipeline, devices) -> None:
    """Run `pipe`'s plan on the physical `devices` from now on: the state goes through a checkpoint
    in a temporary folder, read back as `sw.load` reads one, into a runtime on them; `pipe` (and
    `pipe.optimizer`, which a scheduler may hold) keep working. One process only."""
    if pipe.context is not None:
        raise OptionError("pipe.resize under torch.distributed: each process runs one device; restart the job on "
                          "the new processes and restore the latest checkpoint (pipe.restore)")
    pipe.wait_for_save()  # a save in flight reads this runtime's state; its failure is told here
    plan = remapped(pipe.plan, devices, "pipe.resize")
    trusted = trusted_by_name([n.target for w in pipe._workers for n in w.module.graph.nodes
                               if n.op == "call_function" and callable(n.target)])  # this process runs them
    with tempfile.TemporaryDirectory() as folder:
        pipe.save(Path(folder) / "ck")
        saved = read_checkpoint(Path(folder) / "ck", None)
        runtime, unheld = reopen(saved, rebuild_checkpoint(saved, trusted).stages, plan, trusted, None)
    view, resumed, timeout, reduction = pipe._optimizer, pipe._resumed, pipe.timeout_s, pipe.loss_reduction
    training, padding = pipe.training, pipe._feeding.padding
    pipe._executor.threads.close()
    pipe._rebuild(plan, runtime, unheld)
    pipe._resumed, pipe.timeout_s, pipe.loss_reduction = resumed, timeout, reduction
    pipe._feeding.padding = padding
    if pipe.training != training:
        pipe.train(training)
    if view is not None:
        view.rebind(plan, pipe._workers, pipe._executor.settle)
        pipe._optimizer = view
