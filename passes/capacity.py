"""Whether a plan fits: each device's pool, and the RAM of each host for what the plan keeps there.

A device's pool is bounded by its `memory`; the RAM of the machine it sits on bounds what the
runtime keeps beside it, and the devices of one machine (one `DeviceSpec.host`) share that RAM.
Per stage instance the runtime keeps (runtime/worker.py, runtime/undo.py, runtime/stash.py):

- swapped training state (Harmony): the weights, gradients and optimizer state, in host memory
  between their uses;
- with the optimizer on the host (ZeRO-Offload): the fp32 masters, the gradients sent for the
  update and the optimizer's state;
- the undo record of each update (a failed step is rolled back): a host copy, kept from step to
  step, of every tensor the update may write as the step found it: the weights and optimizer
  state (a swapped stage's host copies; with a host optimizer its masters and state, and the
  device's weights where they stay there; under 2bw the second version of its trained weights);
- swapped stashes: as many of a stage's stashes as it holds in flight at once.

A CPU device's pool is that RAM too, so its predicted peak joins its host's use.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from stagewise.ir.devices import DeviceSpec, format_bytes
from stagewise.ir.errors import CapacityError
from stagewise.ir.instructions import Phase
from stagewise.ir.plan import Stage, Task
from stagewise.passes.swap import SwapPlan


@dataclass(frozen=True)
class HostOver:
    """A host whose RAM cannot hold what the plan keeps there."""

    host: int
    needed: int
    capacity: int

    def describe(self) -> str:
        return (f"host {self.host} would keep {format_bytes(self.needed)} in its "
                f"{format_bytes(self.capacity)} of host memory")


def host_bytes(stages: Sequence[Stage], swaps: SwapPlan, tasks: Sequence[Sequence[Task]], devices: int,
               optimizer_on_host: bool, host_optimizer_bytes: float, weight_versions: int = 1) -> tuple[int, ...]:
    """Per device, the bytes the runtime keeps in host memory for its stage instances (module
    docstring); `host_optimizer_bytes`: the optimizer's state per trainable byte when it steps on
    the host (the plan's `swaps` then carries no optimizer bytes); `weight_versions`: 2 under 2bw,
    whose undo record holds the second version of the trained weights too."""
    held = [0] * devices
    for stage in stages:
        held[stage.device] += _stage_bytes(stage.index, swaps, optimizer_on_host, host_optimizer_bytes)
        held[stage.device] += (weight_versions - 1) * swaps.grad_bytes.get(stage.index, 0)
        if swaps.swaps_stash(stage.index):
            in_flight = _most_in_flight(tasks[stage.device] if stage.device < len(tasks) else (), stage.index)
            held[stage.device] += in_flight * swaps.stash_bytes.get(stage.index, 0)
    return tuple(held)


def _stage_bytes(stage: int, swaps: SwapPlan, optimizer_on_host: bool, host_optimizer_bytes: float) -> int:
    """Kept state and the undo record of one stage instance (module docstring)."""
    weights, grads = swaps.weight_bytes.get(stage, 0), swaps.grad_bytes.get(stage, 0)
    swapped = swaps.swaps(stage)
    if optimizer_on_host:
        state = round(grads * host_optimizer_bytes)
        kept = weights + grads + state  # masters, gradients, optimizer state
        undo = weights + state + (0 if swapped else weights)  # a resident stage's device weights too
        return kept + undo
    optimizer = swaps.optimizer_bytes.get(stage, 0)
    kept = weights + grads + optimizer if swapped else 0
    return kept + weights + optimizer


def _most_in_flight(tasks: Sequence[Task], stage: int) -> int:
    """The most stashes of `stage` alive at once in a device's task order (a forward or recompute
    that stashes makes one, the backward ends it)."""
    live = most = 0
    for task in tasks:
        if task.stage != stage:
            continue
        if task.phase is Phase.RECOMPUTE or (task.phase is Phase.FORWARD and task.stash):
            live += 1
        elif task.phase.ends_stash:
            live -= 1
        most = max(most, live)
    return most


def host_use(devices: Sequence[DeviceSpec], held: Sequence[int], peaks: Sequence[int]) -> dict[int, int]:
    """Per host, the bytes its RAM holds: what each of its devices keeps there (`held`, empty when
    unknown), and the pool peaks of its CPU devices."""
    use: dict[int, int] = {}
    for d, spec in enumerate(devices):
        pool = peaks[d] if spec.kind == "cpu" and d < len(peaks) else 0
        use[spec.host] = use.get(spec.host, 0) + (held[d] if d < len(held) else 0) + pool
    return use


def hosts_over(devices: Sequence[DeviceSpec], use: dict[int, int]) -> list[HostOver]:
    """The hosts whose RAM (the smallest `host_memory` their devices state) `use` exceeds."""
    capacity: dict[int, int] = {}
    for spec in devices:
        if spec.host_memory is not None:
            capacity[spec.host] = min(capacity.get(spec.host, spec.host_memory), spec.host_memory)
    return [HostOver(host, use[host], capacity[host]) for host in sorted(use)
            if host in capacity and use[host] > capacity[host]]


@dataclass(frozen=True)
class Fit:
    """Whether a candidate's predicted peaks fit its devices' pools and its hosts' RAM."""

    fits: bool
    pools_fit: bool
    hosts_over: tuple[HostOver, ...]


def pools_fit(devices: Sequence[DeviceSpec], peaks: Sequence[int]) -> bool:
    """Every device's peak within its `memory`."""
    return all(d.memory is None or peak <= d.memory for d, peak in zip(devices, peaks, strict=True))


def check_fit(devices: Sequence[DeviceSpec], peaks: Sequence[int], held: Sequence[int]) -> Fit:
    """Every device's peak within its `memory`, and every host's use (`host_use`) within its RAM."""
    over = tuple(hosts_over(devices, host_use(devices, held, peaks)))
    pools = pools_fit(devices, peaks)
    return Fit(pools and not over, pools, over)


def shortfalls(peaks: Sequence[int], over_hosts: Sequence[HostOver], devices: Sequence[DeviceSpec]) -> list[str]:
    """Each device whose predicted peak exceeds its memory, then each host over its RAM, in words."""
    return ([f"device {d} would need {format_bytes(peak)} of its {format_bytes(spec.memory)}"
             for d, (peak, spec) in enumerate(zip(peaks, devices, strict=True))
             if spec.memory is not None and peak > spec.memory]
            + [host.describe() for host in over_hosts])


def nothing_fits(plan: str, peaks: Sequence[int], over_hosts: Sequence[HostOver],
                 devices: Sequence[DeviceSpec]) -> CapacityError:
    """The error when no candidate fits, from the best one (`plan` describes it): which devices'
    pools or which hosts' RAM it exceeds, and what to change."""
    detail = ", ".join(shortfalls(peaks, over_hosts, devices))
    if over_hosts and pools_fit(devices, peaks):
        return CapacityError(
            f"no plan fits the host memory: {detail}; the best plan ({plan}) keeps there its swapped state and "
            "stashes, a host optimizer's state and the undo copy of each update. Use hosts with more RAM "
            "(host_memory=), more devices or instances, or devices with more memory (less to swap)."
        )
    return CapacityError(
        f"no plan fits the devices' memory even with swapping: the best ({plan}) predicts {detail}. Give the "
        "devices more memory, add devices, use a smaller batch or more microbatches (smaller activations)."
    )
