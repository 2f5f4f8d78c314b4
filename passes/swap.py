"""Which stage state lives in host memory, and the swap instructions that move it (Harmony §3-4).

`Residency` follows one device's program as it is lowered and emits a swap-in before a
compute that needs state not on the device, and the evictions the policy asks for:

- "harmony": state stays for a whole run of one pack's tasks (input-batch grouping); after a
  forward run the unchanged weights are freed, not written back; after the pack's update
  (jit-update) weights and optimizer state are written back. Weights move 3|W| per iteration
  in total (App. B, Table 3), less where a pack's forward and backward runs are adjacent.
- "per-device": the baseline of per-GPU memory virtualization: in before and out after every
  task, (4m + 2)|W| for weights.

A swap-in of weights waits until the weights evicted `depth` evictions earlier are gone, so at
most `depth` packs are resident: 2 is double buffering (prefetch the next pack while the
current one computes), 1 when the device holds only one pack's state at a time.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from stagewise.compiler.ir import Instruction

MODES = ("off", "harmony", "per-device")


@dataclass(frozen=True)
class SwapPlan:
    mode: str = "off"
    stages: frozenset[int] = frozenset()  # stage instances whose state lives on the host between uses
    weight_bytes: dict[int, int] = field(default_factory=dict)
    grad_bytes: dict[int, int] = field(default_factory=dict)
    optimizer_bytes: dict[int, int] = field(default_factory=dict)
    depth: int = 2

    def swaps(self, stage: int) -> bool:
        return self.mode != "off" and stage in self.stages


class Residency:
    """Emits swap instructions into `code` (one device's program under construction)."""

    def __init__(self, plan: SwapPlan, code: list[Instruction]):
        self.plan = plan
        self.code = code
        self.resident: set[tuple[int, str]] = set()
        self.on_host: set[tuple[int, str]] = set()
        self.weight_evictions: list[int] = []

    def need(self, stage: int, what: str) -> None:
        """Make `what` of `stage` resident before the next compute that uses it."""
        key = (stage, what)
        if not self.plan.swaps(stage) or key in self.resident:
            return
        self.resident.add(key)
        if what == "grads" and key not in self.on_host:
            return  # not made yet: the first backward creates it on the device
        waits = ()
        if what == "weights" and len(self.weight_evictions) >= self.plan.depth:
            waits = (self.weight_evictions[-self.plan.depth],)
        self.code.append(Instruction("swap_in", "swap_in", stage, what=what, waits=waits, nbytes=self._bytes(stage, what)))

    def evict(self, stage: int, what: str, write: bool) -> None:
        """Take `what` of `stage` off the device, writing it to host memory if it changed."""
        key = (stage, what)
        if not self.plan.swaps(stage) or key not in self.resident:
            return
        self.resident.discard(key)
        kind = "swap_out" if write else "free"
        if write:
            self.on_host.add(key)
        self.code.append(Instruction(kind, "swap_out", stage, what=what, nbytes=self._bytes(stage, what) if write else 0))
        if what == "weights":
            self.weight_evictions.append(len(self.code) - 1)

    def consumed(self, stage: int, what: str) -> None:
        """The update used up the gradients: nothing to keep on the host."""
        self.resident.discard((stage, what))
        self.on_host.discard((stage, what))

    def _bytes(self, stage: int, what: str) -> int:
        table = {"weights": self.plan.weight_bytes, "grads": self.plan.grad_bytes, "optimizer": self.plan.optimizer_bytes}
        return table[what].get(stage, 0)
