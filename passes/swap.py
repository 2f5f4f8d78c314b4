"""Which stage state lives in host memory, and the swap instructions that move it (Harmony §3-4).

`Residency` follows one device's program as it is lowered and emits a swap-in before a
compute that needs state not on the device, and the evictions the policy asks for:

- "harmony": state stays for a whole run of one pack's tasks (input-batch grouping); after a
  forward run the unchanged weights are freed, not written back; after the pack's update
  (jit-update) weights and optimizer state are written back. Weights move 3|W| per iteration
  in total (App. B, Table 3), less where a pack's forward and backward runs are adjacent.
- "per-device": the baseline of per-GPU memory virtualization: in before and out after every
  task, (4m + 2)|W| for weights.

A swap-in waits until the state of the same kind evicted `depth` evictions earlier is gone, so
at most `depth` packs' state is resident: 2 is double buffering (prefetch the next pack while
the current one computes), 1 when the device holds only one pack's state at a time.

With the optimizer on the host (Harmony's CPU update, ZeRO-Offload) the device never holds
optimizer state: an update sends the gradients to host memory, the host steps its fp32 master
copy of the weights, and a stage whose weights stay on the device gets them back (`refresh`);
a swapped stage's next swap-in reads the updated master, so its device copy is only freed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from stagewise.compiler.errors import PlanError
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
        self.evictions: dict[str, list[int]] = {"weights": [], "grads": [], "optimizer": []}

    def need(self, stage: int, what: str) -> None:
        """Make `what` of `stage` resident before the next compute that uses it (gradients and
        optimizer state belong to parameters: the weights come first)."""
        if what != "weights":
            self.need(stage, "weights")
        key = (stage, what)
        if not self.plan.swaps(stage) or key in self.resident:
            return
        self.resident.add(key)
        if what == "grads" and key not in self.on_host:
            return  # not made yet: the first backward creates it on the device
        waits = ()
        evicted = self.evictions[what]
        if len(evicted) >= self.plan.depth:
            waits = (evicted[-self.plan.depth],)
        self.code.append(Instruction("swap_in", "swap_in", stage, what=what, waits=waits, nbytes=self._bytes(stage, what)))

    def evict(self, stage: int, what: str, write: bool) -> None:
        """Take `what` of `stage` off the device, writing it to host memory if it changed
        (gradients leave before their weights)."""
        if what == "weights":
            self.evict(stage, "grads", write=True)
        key = (stage, what)
        if not self.plan.swaps(stage) or key not in self.resident:
            return
        self.resident.discard(key)
        kind = "swap_out" if write else "free"
        if write:
            self.on_host.add(key)
        self.code.append(Instruction(kind, "swap_out", stage, what=what, nbytes=self._bytes(stage, what) if write else 0))
        self.evictions[what].append(len(self.code) - 1)

    def grads_to_host(self, stage: int) -> None:
        """Host optimizer: the gradients go to host memory for the update. A swapped stage's weights
        leave with them unchanged (freed: the host master is the copy the update changes)."""
        if self.plan.swaps(stage):
            self.evict(stage, "weights", write=False)
        elif (stage, "grads") not in self.on_host:
            self.on_host.add((stage, "grads"))
            self.code.append(Instruction("swap_out", "swap_out", stage, what="grads", nbytes=self._bytes(stage, "grads")))

    def keep_only(self, stages) -> None:
        """Before the deferred updates bring in the next stages' state: evict every other swapped
        stage still resident (so at most `depth` stages' state is on the device). Nothing has
        updated weights yet at that point: gradients are written, weights freed."""
        for stage in sorted({s for s, what in self.resident if what == "weights"} - set(stages)):
            self.evict(stage, "weights", write=False)
            self.evict(stage, "optimizer", write=True)

    def refresh(self, stage: int) -> None:
        """Host optimizer: after the host update, a stage whose weights live on the device copies the
        updated master back (a swapped stage's next swap-in reads it anyway)."""
        if not self.plan.swaps(stage):
            self.code.append(Instruction("swap_in", "swap_in", stage, what="weights", nbytes=self._bytes(stage, "weights")))

    def consumed(self, stage: int, what: str) -> None:
        """The update used up the gradients: nothing to keep on the host."""
        self.resident.discard((stage, what))
        self.on_host.discard((stage, what))

    def _bytes(self, stage: int, what: str) -> int:
        table = {"weights": self.plan.weight_bytes, "grads": self.plan.grad_bytes, "optimizer": self.plan.optimizer_bytes}
        return table[what].get(stage, 0)


def plan_swaps(mode: str, stages, layers, capacities: list[int | None], state_per_param_byte: float) -> SwapPlan:
    """The swap plan for `swap=`: "off", "on" (Harmony-style everywhere), "per-device" (baseline),
    or "auto": Harmony-style swapping only on devices whose stages' training state exceeds their capacity."""
    weights = {s.index: sum(layers[i].param_bytes for i in s.layers) for s in stages}
    state = {k: v * state_per_param_byte for k, v in weights.items()}
    if mode == "auto":
        heavy = set()
        for device, capacity in enumerate(capacities):
            mine = [s.index for s in stages if s.device == device]
            if capacity is not None and sum(state[s] for s in mine) > capacity:
                heavy |= set(mine)
        mode, chosen = ("harmony", frozenset(heavy)) if heavy else ("off", frozenset())
    elif mode == "on":
        mode, chosen = "harmony", frozenset(weights)
    elif mode in ("off", "per-device"):
        chosen = frozenset(weights) if mode == "per-device" else frozenset()
    else:
        raise PlanError(f"unknown swap={mode!r}; choose 'auto', 'on', 'off' or 'per-device'")
    largest = max((state[s] for s in chosen), default=0)
    # double buffering needs two packs' state, and activations need room beside them
    tight = any(c is not None and 4 * largest > c for c in capacities)
    return SwapPlan(
        mode=mode,
        stages=chosen,
        weight_bytes=weights,
        grad_bytes=weights,
        optimizer_bytes={k: round(v * (state_per_param_byte - 2)) for k, v in weights.items()},
        depth=1 if tight else 2,
    )
