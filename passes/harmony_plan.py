"""Harmony's search (passes/harmony_packing.py, Alg. 1 and 2) over this compiler's layers and costs.

What the paper's profile phi and capacity alpha are here:

- Alg. 2 packs *units*, the runs of layers no legal cut-point splits (a pack can only end at a
  legal cut, Varuna §5.1); on a model cut-able everywhere a unit is a layer.
- A unit's time is its layers' forward plus backward seconds at the microbatch size. In Harmony
  a backward task recomputes its pack's forward first (§4.3.1), and here the same pack also runs
  the forwards (P_F = P_B), so balancing the packs' time balances each device's whole iteration.
- A unit's memory is what one task of its pack holds: its layers' training state (weights,
  gradients, optimizer state: a pack updates right after its backward, jit-update), one
  microbatch's stashed activations and the workspace. alpha is half the smallest device memory
  given (no limit: none): the runtime holds two packs at once, the next one's swap-in overlapping
  this one's compute (passes/swap.py, Harmony §4.4); where a unit alone needs more than half, the
  whole device, and the packs come in one at a time.
- Alg. 2 starts at S_min = sum(memory) / alpha (line 5). Without a memory limit that is one pack,
  which would leave every device but one idle: S starts at the layout's fewest packs instead
  when that is more (passes/layout.py: two per device of a lane).
- A packing Alg. 2 returns must also fit by the simulator's count (`search_packs`), which sees
  what a pack's own sum cannot: the next pack prefetched beside it, stashes in flight, received
  activations. Where it does not, Alg. 2 goes on to more packs.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from stagewise.ir.choices import Schedule
from stagewise.ir.devices import DeviceSpec
from stagewise.ir.instructions import Phase
from stagewise.ir.plan import Cut, LayerCost
from stagewise.passes.harmony_packing import (
    BACKWARD,
    Configuration,
    CostModel,
    Packs,
    Score,
    balanced_time_packing,
    search_configuration,
)

HARMONY = (Schedule.HARMONY_PP, Schedule.HARMONY_DP)
RESIDENT_PACKS = 2  # packs a device holds at once when their swaps overlap compute (double buffering)


@dataclass(frozen=True)
class PackUnits:
    """The layers in runs that no legal cut splits: `firsts[j]` is unit j's first layer."""

    firsts: tuple[int, ...]
    n_layers: int

    @classmethod
    def of(cls, cuts: Sequence[Cut], n_layers: int) -> PackUnits:
        return cls((0, *(cut.after + 1 for cut in cuts if cut.legal)), n_layers)

    def __len__(self) -> int:
        return len(self.firsts)

    def layers(self, unit: int) -> range:
        stop = self.firsts[unit + 1] if unit + 1 < len(self.firsts) else self.n_layers
        return range(self.firsts[unit], stop)

    def starts(self, packs: Packs) -> list[int]:
        """Each pack's first layer (the plan's stage starts)."""
        return [self.firsts[pack.start] for pack in packs]


@dataclass
class PackCosts:
    """The profile phi over units (a `CostModel`): layer costs at each microbatch size, summed per unit."""

    units: PackUnits
    costs_at: Callable[[int], Sequence[LayerCost]]
    _sizes: dict[int, Sequence[LayerCost]] = field(default_factory=dict)

    def time(self, phase: Phase, microbatch: int, unit: int) -> float:
        layers = self._at(microbatch)
        if phase is BACKWARD:
            return sum(layers[i].fwd_s + layers[i].bwd_s for i in self.units.layers(unit))
        return sum(layers[i].fwd_s for i in self.units.layers(unit))

    def memory(self, phase: Phase, microbatch: int, unit: int) -> float:
        layers = self._at(microbatch)
        return sum(layers[i].state_bytes + layers[i].stash_bytes + layers[i].workspace_bytes
                   for i in self.units.layers(unit))

    def _at(self, microbatch: int) -> Sequence[LayerCost]:
        if microbatch not in self._sizes:
            self._sizes[microbatch] = self.costs_at(microbatch)
        return self._sizes[microbatch]


def device_capacity(devices: Sequence[DeviceSpec]) -> float:
    """The smallest memory given to a device (a pack may run on any), or no limit."""
    return float(min((d.memory for d in devices if d.memory), default=math.inf))


def search_packs(microbatch_sizes: Sequence[int], n_layers: int, costs_at: Callable[[int], Sequence[LayerCost]],
                 cuts: Sequence[Cut], devices: Sequence[DeviceSpec], fewest: int,
                 estimate: Callable[[int, list[int]], Score],
                 fits: Callable[[int, list[int]], bool]) -> tuple[int, list[int]]:
    """Alg. 1 (restricted, passes/harmony_packing.py): the microbatch size and packs' first layers
    that `estimate(size, starts)` scores lowest (passes/harmony_search.py lowers and simulates them).

    Alg. 1 takes its packing method as an input; ours is Alg. 2 at alpha (half a device, or the
    whole one: see the module docstring) followed by the simulator's memory check: Alg. 2's own
    check (line 13) sums a pack's layers, which cannot see the stashes in flight or the activations
    received, so while `fits(size, starts)` says the whole plan would exceed a device, Alg. 2 packs
    again with more, smaller packs (its line 14, "try smaller packs", applied to the simulated peak).
    """
    units = PackUnits.of(cuts, n_layers)

    def packing(phase: Phase, microbatch: int, costs: CostModel, capacity: float, *, n_layers: int, fewest: int) -> Packs:
        alpha = capacity / RESIDENT_PACKS
        if max(costs.memory(phase, microbatch, unit) for unit in range(n_layers)) > alpha:
            alpha = capacity  # a unit fills more than half a device: one pack at a time
        packs = balanced_time_packing(phase, microbatch, costs, alpha, n_layers=n_layers, fewest=fewest)
        while len(packs) < n_layers and not fits(microbatch, units.starts(packs)):
            packs = balanced_time_packing(phase, microbatch, costs, alpha, n_layers=n_layers, fewest=len(packs) + 1)
        return packs

    def score(config: Configuration) -> Score:
        return estimate(config.backward_microbatch, units.starts(config.backward_packs))

    found = search_configuration(len(units), microbatch_sizes, PackCosts(units, costs_at), device_capacity(devices),
                                 score, fewest=fewest, packing=packing)
    return found.config.backward_microbatch, units.starts(found.config.backward_packs)
