"""Where a predicted iteration's time goes, and what bounds it: the plan table's one line.

Why: the iteration time alone hides a plan that spends most of it copying to and from host
memory; the split says so where the plan is shown (`print(plan)`, `stagewise plan`, each
`sw.recommend` row). It is made from the simulator's timeline (passes/sim_split.py) and kept
in the plan, so a loaded plan prints the same.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Bound(enum.StrEnum):
    """The resource an iteration is bound by: what to make faster (or buy more of) first."""

    COMPUTE = "compute"  # the devices' arithmetic (with the pipeline's bubble)
    PCIE = "PCIe"  # the host link: swaps, stashes and the host optimizer's traffic
    NETWORK = "network"  # the links between devices: point-to-point messages and all-reduces
    HOST_MEMORY = "host memory"  # the host's capacity: set where a plan is limited by it (not yet modelled)
    HOST_OPTIMIZER = "host optimizer"  # the optimizer stepping in host memory (ZeRO-Offload), more than the copies


@dataclass(frozen=True)
class TimeSplit:
    """One device's predicted iteration, split so that the parts sum to the iteration time.

    `compute_s`: its compute stream running forwards, recomputes, backwards and updates;
    `allreduce_s`: running all-reduces (from the moment every member has joined); `swap_s`: host
    copies (swaps, stashes, the host optimizer) while neither runs; `p2p_s`: messages in flight
    while none of those runs; `bubble_s`: the rest, the device waiting with nothing of its own in
    flight. `device` is the device split; a plan keeps its busiest device's, the one with the least bubble.
    """

    device: int
    compute_s: float
    bubble_s: float
    swap_s: float
    p2p_s: float
    allreduce_s: float
    bound: Bound

    @property
    def iteration_s(self) -> float:
        return self.compute_s + self.bubble_s + self.swap_s + self.p2p_s + self.allreduce_s

    def parts(self) -> tuple[tuple[str, float], ...]:
        """(label, seconds) of each part, in the order the table shows them."""
        return (("compute", self.compute_s), ("bubble", self.bubble_s), ("swap", self.swap_s),
                ("p2p", self.p2p_s), ("all-reduce", self.allreduce_s))

    def shares(self) -> str:
        """Each part's share of the iteration, parts that took no time left out but compute:
        'compute 62% · bubble 21% · swap 15% · p2p 2%'."""
        total = self.iteration_s
        return " · ".join(f"{label} {_percent(seconds, total)}" for label, seconds in self.parts()
                          if seconds > 0 or label == "compute")

    def percentages(self) -> str:
        """Every part's share in the order of `parts`, for a narrow column: '62/21/15/2/0'."""
        return "/".join(_percent(seconds, self.iteration_s).rstrip("%") for _, seconds in self.parts())

    def __str__(self) -> str:
        return f"{self.shares()} — bound: {self.bound}"


def _percent(seconds: float, total: float) -> str:
    """A share in whole percent; a part that took time but rounds to none is '<1%', not '0%'."""
    share = seconds / total if total > 0 else 0.0
    return "<1%" if 0 < share < 0.005 else f"{share:.0%}"
