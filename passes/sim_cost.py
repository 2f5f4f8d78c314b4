"""What the simulator charges: seconds and bytes per stage, value and link (profiled or analytic)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from stagewise.ir.errors import PlanError
from stagewise.ir.instruction_facts import Activity
from stagewise.ir.instructions import (
    AllReduceGradNorm,
    AllReduceShared,
    Instruction,
    Recv,
    Send,
    StashIn,
    StashOut,
    SwapIn,
    SwapOut,
)
from stagewise.ir.plan import Transfer


@dataclass(frozen=True)
class SimCost:
    """Seconds and bytes the simulator charges; profiled or analytic numbers, per stage and value.

    Per stage s: `forward_s[s]` / `backward_s[s]` seconds for one microbatch, `update_s[s]`
    seconds for the optimizer step, `stash_bytes[s]` held from a microbatch's F to its B, and
    `state_bytes[s]` (parameters, gradients, optimizer state) held all the time; with `grad_bytes`
    the gradients are not part of it but held as the runtime's pool holds them (module docstring of
    passes/simulate.py). Missing
    entries cost nothing. `value_bytes` gives each transferred value's bytes per microbatch
    (its gradient has the same size); `tensor_bytes` each all-reduced shared gradient.
    A link from device a to b has `links[(a, b)]` bytes/s, else `bandwidth`; with
    `duplex=False` both directions share one link. Swaps and stashes cross the device's host
    link, `host_links[d]` bytes/s (else `host_bandwidth`), shared fairly with the swaps in the same
    direction of the devices behind the same host (`hosts[d]`; a device not listed has its own).
    `instruction_s`, `concurrency` and `shared_devices`: the runtime's per-instruction cost and
    host contention (module docstring). `slowed` stretches a device's computes, so that every
    message to it arrives as early as the work it depends on allows (passes/early_arrivals.py).
    """

    forward_s: tuple[float, ...]
    backward_s: tuple[float, ...]
    update_s: tuple[float, ...] = ()
    stash_bytes: tuple[float, ...] = ()
    state_bytes: tuple[float, ...] = ()
    grad_bytes: tuple[float, ...] = ()  # given: gradients are held from a stage's first backward to its update
    value_bytes: dict[str, float] = field(default_factory=dict)
    tensor_bytes: dict[str, float] = field(default_factory=dict)
    bandwidth: float = math.inf
    links: dict[tuple[int, int], float] = field(default_factory=dict)
    latency_s: float = 0.0
    duplex: bool = True
    host_bandwidth: float = math.inf  # bytes/s between a device and host memory (swaps), where host_links has none
    host_links: dict[int, float] = field(default_factory=dict)  # device -> bytes/s of its host link
    hosts: dict[int, int] = field(default_factory=dict)  # device -> the host whose memory link it shares
    instruction_s: float = 0.0  # the runtime's own seconds per instruction
    concurrency: tuple[float, ...] = ()  # speed of each of k computes of `shared_devices` at once
    shared_devices: frozenset[int] = frozenset()  # devices whose compute shares the host
    wake_s: float = 0.0  # added to a shared device's compute after its compute stream sat idle
    update_concurrency: tuple[float, ...] = ()  # as `concurrency`, for updates (U); else `concurrency`
    input_grad_share: tuple[float, ...] = ()  # of backward_s, a split backward's input gradient (Bi); else half
    recorded_bytes: tuple[float, ...] = ()  # held from a split backward's Bi to its W beside the stash
    split_backward_s: tuple[float, ...] = ()  # per stage: what splitting a backward adds to B's seconds
    slowed: dict[int, float] = field(default_factory=dict)  # device -> factor on its computes' seconds (early arrivals)

    @classmethod
    def uniform(cls, n_stages: int, forward_s: float, backward_s: float, **kwargs) -> SimCost:
        """Equal stages: the setting in which the bubble formulas of §4.2.2 hold exactly."""
        return cls((forward_s,) * n_stages, (backward_s,) * n_stages, **kwargs)

    def compute_s(self, ins: Instruction) -> float:
        """Seconds of a forward, recompute, backward (or either half of one) or update (on the device or
        the host): a recompute costs its forward's seconds."""
        activity = ins.facts.activity
        if activity in (Activity.FORWARD, Activity.RECOMPUTE):
            return _at(self.forward_s, ins.stage)
        if activity is Activity.BACKWARD:
            return _at(self.backward_s, ins.stage)
        if activity in (Activity.INPUT_GRAD, Activity.WEIGHT_GRAD):  # split in the shares of Bi and W
            share = self.input_grad_share[ins.stage] if ins.stage < len(self.input_grad_share) else 0.5
            split_s = _at(self.backward_s, ins.stage) + _at(self.split_backward_s, ins.stage)
            return split_s * (share if activity is Activity.INPUT_GRAD else 1 - share)
        return _at(self.update_s, ins.stage)

    def speed_with(self, computing: int, update: bool = False) -> float:
        """Each shared-host compute's speed (an update's, with `update`) while `computing` of them run
        (beyond the measured counts, the last measured throughput split further)."""
        curve = self.update_concurrency if update and self.update_concurrency else self.concurrency
        known = len(curve)
        if computing <= 1 or not known:
            return 1.0
        if computing <= known:
            return curve[computing - 1]
        return curve[-1] * known / computing

    def link(self, src: int, dst: int) -> tuple[int, int]:
        """The key of the link a transfer from src to dst occupies."""
        return (src, dst) if self.duplex else (min(src, dst), max(src, dst))

    def link_bandwidth(self, src: int, dst: int) -> float:
        if (src, dst) in self.links or self.duplex:
            return self.links.get((src, dst), self.bandwidth)
        return self.links.get((dst, src), self.bandwidth)

    def __post_init__(self) -> None:
        if self.bandwidth <= 0 or any(b <= 0 for b in (*self.links.values(), *self.host_links.values())):
            raise PlanError("link bandwidths must be positive bytes/s (math.inf for free transfers)")

    def bytes_of(self, ins: Instruction) -> float:
        """The bytes an instruction moves over the link it crosses (`Facts.crosses`); 0 for the rest."""
        if isinstance(ins, AllReduceGradNorm):
            return 8.0
        if isinstance(ins, AllReduceShared):
            return sum(self.tensor_bytes.get(v, 0.0) for v in ins.tensors)
        if isinstance(ins, Send | Recv):
            return sum(self.value_bytes.get(v, 0.0) for v in ins.values)
        if isinstance(ins, StashIn | StashOut):  # the stash the cost model holds (the device's memory counts it)
            return _at(self.stash_bytes, ins.stage)
        return float(ins.nbytes) if isinstance(ins, SwapIn | SwapOut) else 0.0

    def host_link(self, device: int) -> float:
        """Bytes/s between a device and its host's memory."""
        return self.host_links.get(device, self.host_bandwidth)

    def host_of(self, device: int) -> int:
        """The host whose memory link a device's swaps share; a device not in `hosts` has one of its
        own (a key no listed host uses)."""
        return self.hosts.get(device, -1 - device)

    def allreduce_s(self, ins: AllReduceShared | AllReduceGradNorm, devices: Sequence[int] | None = None) -> float:
        """Ring all-reduce over the member `devices` (default: the group read as devices): every
        member sends and receives 2 (n - 1) / n of the bytes."""
        ring_of = list(ins.group if devices is None else devices)
        n = len(ring_of)
        if n < 2:
            return 0.0
        ring = [self.link_bandwidth(a, b) for a, b in zip(ring_of, ring_of[1:] + ring_of[:1], strict=True)]
        return 2 * (n - 1) / n * self.bytes_of(ins) / min(ring) + 2 * (n - 1) * self.latency_s


def transfer_bytes(transfers: Iterable[Transfer], microbatch_size: int) -> dict[str, float]:
    """`SimCost.value_bytes` from the plan's transfers: bytes per sample times the microbatch size."""
    return {t.value: t.bytes_per_sample * microbatch_size for t in transfers}


def _at(table: tuple[float, ...], stage: int | None) -> float:
    return table[stage] if stage is not None and stage < len(table) else 0.0
