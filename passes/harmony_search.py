"""harmony-pp / harmony-dp plans chosen by Harmony's Alg. 1, each configuration scored by lowering
and simulating it, as the planner scores every candidate plan.

Alg. 1 estimates each configuration's iteration time with Harmony's event-driven simulator over its
task graph (§4.3.1, Fig. 15); here the task graph is the plan's instruction programs and the
simulator is passes/simulate.py, so the prediction charges swaps, transfers and memory as for
every other schedule. A configuration whose predicted peak memory does not fit scores after every
one that does, and one that cannot be built after both (the planner's order). The search runs
once per Harmony schedule over the microbatch sizes of its candidates (one size when the count is
given); the winners then meet the other candidates in the planner's `choose`, and the table lists
every configuration Alg. 1 scored.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from itertools import groupby

from stagewise.ir.costs import NO_RUNTIME_COSTS, RuntimeCosts
from stagewise.ir.devices import DeviceSpec
from stagewise.ir.errors import StagewiseError
from stagewise.ir.plan import Cut, LayerCost
from stagewise.ir.topology import Topology
from stagewise.passes.harmony_plan import HARMONY, search_packs
from stagewise.passes.layout import choose_layout
from stagewise.passes.planner import (
    Assembled,
    Candidate,
    Prediction,
    Verdict,
    choose,
    keep_simplest,
    predict,
    simplicity,
)

Built = tuple[Assembled, Sequence[LayerCost], int]  # a plan, its layers' costs, its microbatch size
Tried = tuple[Candidate, Prediction | str]
Score = tuple[bool, bool, float]  # (not built, does not fit, predicted seconds): lower is better


@dataclass(frozen=True)
class Simulated:
    """One configuration built and simulated, or why it could not be built."""

    built: Built | StagewiseError
    prediction: Prediction | str

    @property
    def score(self) -> Score:
        if isinstance(self.prediction, str):
            return (True, True, math.inf)
        return (False, not self.prediction.fits, self.prediction.iteration_s)


@dataclass
class PackSearch:
    """Alg. 1 over one compile's graph: `build_packs(candidate, starts, stage devices)` builds a
    candidate at the packs given; the rest is what a prediction charges."""

    build_packs: Callable[[Candidate, tuple[int, ...], tuple[int, ...]], Built]
    batch: int
    n_layers: int
    cuts: Sequence[Cut]
    costs_at: Callable[[int], Sequence[LayerCost]]
    devices: Sequence[DeviceSpec]
    topology: Topology
    runtime: RuntimeCosts = NO_RUNTIME_COSTS
    simulated: dict[tuple[Candidate, tuple[int, ...]], Simulated] = field(default_factory=dict)

    def build(self, candidate: Candidate) -> Built:
        """`candidate` at the packs Alg. 1 chooses at its one microbatch size."""
        _, chosen, _ = self.search([candidate])
        if isinstance(chosen.built, StagewiseError):
            raise chosen.built
        return chosen.built

    def search(self, group: Sequence[Candidate]) -> tuple[Candidate, Simulated, list[Tried]]:
        """Alg. 1 over one schedule's candidates (one per microbatch count): the best, built and
        simulated, and a row per configuration scored."""
        by_size = {self.batch // option.microbatches: option for option in group}
        layout = choose_layout(group[0].schedule, len(self.devices), 1, sum(cut.legal for cut in self.cuts))
        on = tuple(layout.device_of(s, 0) for s in range(self.n_layers))
        rows: list[Tried] = []
        scored: list[tuple[Candidate, Simulated]] = []

        def simulate(size: int, starts: list[int]) -> Simulated:
            return self._simulate(by_size[size], tuple(starts), on[:len(starts)])

        def estimate(size: int, starts: list[int]) -> Score:
            rows.append((by_size[size], simulate(size, starts).prediction))
            scored.append((by_size[size], simulate(size, starts)))
            return simulate(size, starts).score

        def fits(size: int, starts: list[int]) -> bool:
            # more packs cannot mend a plan that does not build, nor one its hosts' RAM cannot hold
            found = simulate(size, starts)
            return found.score[0] or (isinstance(found.prediction, Prediction) and found.prediction.pools_fit)

        try:
            size, starts = search_packs(sorted(by_size), self.n_layers, self.costs_at, self.cuts, self.devices,
                                        layout.positions, estimate, fits)
        except StagewiseError as error:  # at no size can Alg. 2 pack the layers
            return group[0], Simulated(error, str(error)), [(option, str(error).splitlines()[0]) for option in group]
        return (*_simplest_within_margin(scored, (by_size[size], simulate(size, starts))), rows)

    def _simulate(self, option: Candidate, starts: tuple[int, ...], on: tuple[int, ...]) -> Simulated:
        key = (option, starts)
        if key not in self.simulated:
            try:
                built = self.build_packs(option, starts, on)
            except StagewiseError as error:
                self.simulated[key] = Simulated(error, str(error).splitlines()[0])
            else:
                prediction, _ = predict(built[0], built[1], self.devices, built[2], self.topology, self.runtime)
                self.simulated[key] = Simulated(built, prediction)
        return self.simulated[key]


def choose_with_harmony(options: Sequence[Candidate], build: Callable[[Candidate], Built],
                        search: PackSearch) -> tuple[Assembled, Prediction, list[Tried], Verdict]:
    """The planner's `choose`, with each Harmony schedule's candidates replaced by Alg. 1's pick among them
    (a candidate replicating single stages goes to `build`, which refuses it for Harmony)."""
    searched = sorted((o for o in options if _packed(o)), key=lambda o: o.schedule)
    winners: dict[Candidate, Simulated] = {}
    tried: list[Tried] = []
    for _, group in groupby(searched, key=lambda o: o.schedule):
        winner, simulated, rows = search.search(list(group))
        winners[winner] = simulated
        tried += rows

    def build_winner(option: Candidate) -> Built:
        if option not in winners:
            return build(option)
        built = winners[option].built
        if isinstance(built, StagewiseError):
            raise built
        return built

    finalists = [o for o in options if not _packed(o)] + list(winners)
    plan, prediction, others, verdict = choose(finalists, build_winner, search.devices, search.topology, search.runtime)
    rows = [row for row in others if row[0] not in winners] + tried
    return plan, prediction, rows, _fastest_of_every_row(verdict, rows)


def _fastest_of_every_row(verdict: Verdict, rows: Sequence[Tried]) -> Verdict:
    """The verdict with the fastest of every row that fits, Alg. 1's configurations included: each
    schedule's winner is already the simplest within the margin of its faster configurations, so
    the fastest finalist need not be the fastest row, and the table must not call the kept one so."""
    fitting = [(option, result.iteration_s) for option, result in rows if isinstance(result, Prediction) and result.fits]
    option, seconds = min(fitting, key=lambda row: row[1], default=(verdict.fastest, verdict.fastest_s))
    return verdict if seconds >= verdict.fastest_s else replace(verdict, fastest=option, fastest_s=seconds)


def _simplest_within_margin(scored: Sequence[tuple[Candidate, Simulated]],
                            alg1: tuple[Candidate, Simulated]) -> tuple[Candidate, Simulated]:
    """Alg. 1's pick made stable as the planner's (`keep_simplest`): among the configurations it scored
    that built and fit, the simplest within PLAN_MARGIN of the fastest; when none fits, the fastest that
    fits the devices' pools (only host memory is short: the planner's refusal names it), else Alg. 1's own."""
    predicted = [(option, found, found.built[0], found.prediction) for option, found in scored
                 if not isinstance(found.built, StagewiseError) and isinstance(found.prediction, Prediction)]
    fitting = [row for row in predicted if row[3].fits]
    if not fitting:
        pooled = [row for row in predicted if row[3].pools_fit]
        fastest = min(pooled, key=lambda row: row[3].iteration_s, default=None)
        return alg1 if fastest is None else (fastest[0], fastest[1])
    kept, _ = keep_simplest([(simplicity(plan), prediction) for _, _, plan, prediction in fitting])
    return fitting[kept][0], fitting[kept][1]


def _packed(option: Candidate) -> bool:
    return option.schedule in HARMONY and not option.replicates_stages
