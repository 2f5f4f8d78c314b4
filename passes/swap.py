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

Stashed activations (Table 3's sX row): a stage in `SwapPlan.stash` writes each microbatch's
stash to host memory right after the forward that made it (`StashOut`, once its outputs
are sent) and brings it back for that microbatch's backward (`StashIn`, issued on the
swap-in stream so that it overlaps the compute before the backward). A stash whose backward is
the device's very next task stays (it would come straight back). Every stash of such a stage that
is on the device is one residency: a forward that stashes or a swap-in waits until the residency
`stash_depth` earlier has ended (swapped out, or its backward done), so at most `stash_depth`
of them are on the device at once: 2 overlaps one's copy with the next one's compute.

`plan_swaps` decides. State: Harmony-style where the device cannot hold its stages' training
state ("auto"), everywhere ("on"), per task ("per-device"), never ("off"). Stashes: where the
device cannot hold the stashes its schedule keeps in flight beside the state it keeps resident
(every mode but "off"), or every stage's ("all": state as "on", and every stash).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field

from stagewise.ir.choices import parse_choice
from stagewise.ir.costs import optimizer_state_per_param_byte
from stagewise.ir.instructions import Free, Instruction, Phase, StashIn, StashOut, State, SwapIn, SwapOut
from stagewise.ir.plan import Layer, Stage, Task


class SwapMode(enum.StrEnum):
    """compile's `swap=`: where training state and stashed activations go to host memory (AUTO:
    only where they do not fit; ON: state everywhere, Harmony-style; ALL: ON and every stage's
    stashes; OFF: never; PER_DEVICE: the per-GPU baseline).

    Example:
        >>> sw.SwapMode("per-device")
        <SwapMode.PER_DEVICE: 'per-device'>
    """

    AUTO = "auto"  # state only on devices it does not fit; stashes where they do not fit
    ON = "on"  # Harmony-style state swapping everywhere
    ALL = "all"  # ON, and every stage's stashes (Harmony's sX)
    OFF = "off"  # never
    PER_DEVICE = "per-device"  # the per-GPU baseline


class StateSwap(enum.StrEnum):
    """How a swap plan moves training state: not at all, Harmony-style, or the per-device baseline."""

    OFF = "off"
    HARMONY = "harmony"
    PER_DEVICE = "per-device"


@dataclass(frozen=True)
class SwapPlan:
    mode: StateSwap = StateSwap.OFF
    stages: frozenset[int] = frozenset()  # stage instances whose state lives on the host between uses
    weight_bytes: dict[int, int] = field(default_factory=dict)
    grad_bytes: dict[int, int] = field(default_factory=dict)
    optimizer_bytes: dict[int, int] = field(default_factory=dict)
    depth: int = 2
    stash: frozenset[int] = frozenset()  # stage instances whose stashed activations wait in host memory (sX)
    stash_bytes: dict[int, int] = field(default_factory=dict)  # planned stash of one microbatch, per stage
    stash_depth: int = 2  # swapped stashes on a device at once

    def swaps(self, stage: int) -> bool:
        return self.mode != StateSwap.OFF and stage in self.stages

    def swaps_stash(self, stage: int) -> bool:
        return stage in self.stash


class Residency:
    """Emits swap instructions into `code` (one device's program under construction)."""

    def __init__(self, plan: SwapPlan, code: list[Instruction]):
        self.plan = plan
        self.code = code
        self.resident: set[tuple[int, State]] = set()
        self.on_host: set[tuple[int, State]] = set()
        self.evictions: dict[State, list[int]] = {state: [] for state in State}
        self.stash_ends: list[int | None] = []  # per residency of a swapped stage's stash: the instruction ending it
        self.open_stash: dict[tuple[int, int], int] = {}  # (stage, microbatch) -> its residency, while on the device
        self.stash_on_host: set[tuple[int, int]] = set()

    def need(self, stage: int, what: State) -> None:
        """Make `what` of `stage` resident before the next compute that uses it (gradients and
        optimizer state belong to parameters: the weights come first)."""
        if what is not State.WEIGHTS:
            self.need(stage, State.WEIGHTS)
        key = (stage, what)
        if not self.plan.swaps(stage) or key in self.resident:
            return
        self.resident.add(key)
        if what is State.GRADS and key not in self.on_host:
            return  # not made yet: the first backward creates it on the device
        waits: tuple[int, ...] = ()
        evicted = self.evictions[what]
        if len(evicted) >= self.plan.depth:
            waits = (evicted[-self.plan.depth],)
        self.code.append(SwapIn(stage, what, self._bytes(stage, what), waits=waits))

    def evict(self, stage: int, what: State, write: bool) -> None:
        """Take `what` of `stage` off the device, writing it to host memory if it changed
        (gradients leave before their weights)."""
        if what is State.WEIGHTS:
            self.evict(stage, State.GRADS, write=True)
        key = (stage, what)
        if not self.plan.swaps(stage) or key not in self.resident:
            return
        self.resident.discard(key)
        if write:
            self.on_host.add(key)
        self.code.append(SwapOut(stage, what, self._bytes(stage, what)) if write else Free(stage, what))
        self.evictions[what].append(len(self.code) - 1)

    def grads_to_host(self, stage: int) -> None:
        """Host optimizer: the gradients go to host memory for the update. A swapped stage's weights
        leave with them unchanged (freed: the host master is the copy the update changes)."""
        if self.plan.swaps(stage):
            self.evict(stage, State.WEIGHTS, write=False)
        elif (stage, State.GRADS) not in self.on_host:
            self.on_host.add((stage, State.GRADS))
            self.code.append(SwapOut(stage, State.GRADS, self._bytes(stage, State.GRADS)))

    def keep_only(self, stages: Iterable[int]) -> None:
        """Before the deferred updates bring in the next stages' state: evict every other swapped
        stage still resident (so at most `depth` stages' state is on the device). Nothing has
        updated weights yet at that point: gradients are written, weights freed."""
        for stage in sorted({s for s, what in self.resident if what is State.WEIGHTS} - set(stages)):
            self.evict(stage, State.WEIGHTS, write=False)
            self.evict(stage, State.OPTIMIZER, write=True)

    def refresh(self, stage: int) -> None:
        """Host optimizer: after the host update, a stage whose weights live on the device copies the
        updated master back (a swapped stage's next swap-in reads it anyway)."""
        if not self.plan.swaps(stage):
            self.code.append(SwapIn(stage, State.WEIGHTS, self._bytes(stage, State.WEIGHTS)))

    def consumed(self, stage: int, what: State) -> None:
        """The update used up the gradients: nothing to keep on the host."""
        self.resident.discard((stage, what))
        self.on_host.discard((stage, what))

    # ---- stashed activations (sX) ---------------------------------------------------------------
    def stash_arrives(self, stage: int, microbatch: int) -> tuple[int, ...]:
        """A forward (or recompute) of `stage` is about to stash `microbatch`: the events it waits
        for so that at most `stash_depth` swapped stashes are on the device (none if the stage keeps
        its stashes)."""
        if not self.plan.swaps_stash(stage):
            return ()
        return self._open_stash(stage, microbatch)

    def stash_out(self, stage: int, microbatch: int) -> None:
        """After the forward and the sends of its outputs: the stash to host memory."""
        self.code.append(StashOut(stage, microbatch, self.plan.stash_bytes.get(stage, 0)))
        self.stash_ends_at(stage, microbatch, len(self.code) - 1)
        self.stash_on_host.add((stage, microbatch))

    def stash_in(self, stage: int, microbatch: int) -> None:
        """Before the microbatch's backward: its stash back from host memory, if it went there."""
        if (stage, microbatch) not in self.stash_on_host:
            return
        self.stash_on_host.discard((stage, microbatch))
        waits = self._open_stash(stage, microbatch)
        self.code.append(StashIn(stage, microbatch, self.plan.stash_bytes.get(stage, 0), waits=waits))

    def stash_ends_at(self, stage: int, microbatch: int, index: int) -> None:
        """Instruction `index` ends the residency of the stash (its swap-out, or the backward)."""
        residency = self.open_stash.pop((stage, microbatch), None)
        if residency is not None:
            self.stash_ends[residency] = index

    def _open_stash(self, stage: int, microbatch: int) -> tuple[int, ...]:
        depth = self.plan.stash_depth
        ended = self.stash_ends[-depth] if len(self.stash_ends) >= depth else None
        waits = (ended,) if ended is not None else ()
        self.stash_ends.append(None)
        self.open_stash[(stage, microbatch)] = len(self.stash_ends) - 1
        return waits

    def _bytes(self, stage: int, what: State) -> int:
        table = {State.WEIGHTS: self.plan.weight_bytes, State.GRADS: self.plan.grad_bytes,
                 State.OPTIMIZER: self.plan.optimizer_bytes}
        return table[what].get(stage, 0)


def plan_swaps(mode: SwapMode | str, stages: Sequence[Stage], layers: Sequence[Layer], capacities: list[int | None], state_per_param_byte: float,
               tasks: Sequence[Sequence[Task]] = (), stash_bytes: Sequence[float] = (),
               grad_bytes: Sequence[float] | None = None, stash_stages: AbstractSet[int] | None = None) -> SwapPlan:
    """The swap plan for `swap=`: "off", "on" (Harmony-style everywhere), "all" ("on", and every stage's
    stashed activations), "per-device" (baseline), or "auto": Harmony-style swapping only on devices
    whose stages' training state exceeds their capacity. In every mode but "off" and "all", a device's
    stashes are swapped where they do not fit beside the state it keeps (`tasks[d]`: device d's
    schedule, which says how many stashes are in flight; `stash_bytes`: one microbatch's per layer).
    `grad_bytes`: per layer, the bytes of its trainable parameters, the only ones with gradients and
    optimizer state (None: every parameter trains). `stash_stages`: the stages whose stashes go to host
    memory, chosen per stage (passes/activations.py); None: as `mode` says."""
    requested = parse_choice(SwapMode, mode, "swap=")
    weights = {s.index: sum(layers[i].param_bytes for i in s.layers) for s in stages}
    grads = weights if grad_bytes is None else {s.index: round(sum(grad_bytes[i] for i in s.layers)) for s in stages}
    # the weights, and per trainable byte its gradient and optimizer state
    state = {k: weights[k] + grads[k] * (state_per_param_byte - 1) for k in weights}
    stash = {s.index: round(sum(stash_bytes[i] for i in s.layers if i < len(stash_bytes))) for s in stages}
    kind, chosen = _state_swap(requested, stages, state, capacities)
    largest = max((state[s] for s in chosen), default=0)
    # double buffering needs two packs' state, and activations need room beside them
    tight = any(c is not None and 4 * largest > c for c in capacities)
    depth = 1 if tight else 2
    device_of = {s.index: s.device for s in stages}
    resident = [_resident_state(state, chosen, depth, [s for s in state if device_of[s] == d]) for d in range(len(capacities))]
    swapped_stash = _swapped_stashes(requested, stash_stages, stash, tasks, resident, capacities)
    stash_depth = 2
    for d, capacity in enumerate(capacities):
        mine = [stash[s] for s in swapped_stash if device_of[s] == d]
        if capacity is not None and mine and resident[d] + 2 * max(mine) > capacity:
            stash_depth = 1
    return SwapPlan(
        mode=kind,
        stages=chosen,
        weight_bytes=weights,
        grad_bytes=grads,
        optimizer_bytes={k: round(v * optimizer_state_per_param_byte(state_per_param_byte)) for k, v in grads.items()},
        depth=depth,
        stash=swapped_stash,
        stash_bytes=stash,
        stash_depth=stash_depth,
    )


def _state_swap(requested: SwapMode, stages: Sequence[Stage], state: dict[int, float],
                capacities: list[int | None]) -> tuple[StateSwap, frozenset[int]]:
    """How state moves and which stages' state moves: "auto" only the stages of devices whose state
    exceeds their capacity, "on" and "all" every stage Harmony-style, "per-device" every stage."""
    if requested == SwapMode.AUTO:
        heavy: set[int] = set()
        for device, capacity in enumerate(capacities):
            mine = [s.index for s in stages if s.device == device]
            if capacity is not None and sum(state[s] for s in mine) > capacity:
                heavy |= set(mine)
        return (StateSwap.HARMONY, frozenset(heavy)) if heavy else (StateSwap.OFF, frozenset())
    if requested in (SwapMode.ON, SwapMode.ALL):
        return StateSwap.HARMONY, frozenset(state)
    if requested == SwapMode.PER_DEVICE:
        return StateSwap.PER_DEVICE, frozenset(state)
    return StateSwap.OFF, frozenset()


def _swapped_stashes(requested: SwapMode, stash_stages: AbstractSet[int] | None, stash: dict[int, int],
                     tasks: Sequence[Sequence[Task]], resident: list[float],
                     capacities: list[int | None]) -> frozenset[int]:
    """The stages whose stashes go to host memory: those chosen per stage, every stashing one under
    "all", none under "off", else where a device's stashes in flight do not fit beside its state."""
    if stash_stages is not None:
        return frozenset(s for s in stash_stages if stash.get(s, 0) > 0)
    if requested == SwapMode.ALL:
        return frozenset(s for s, b in stash.items() if b > 0)
    if requested == SwapMode.OFF:
        return frozenset()
    return frozenset().union(*(
        _stashes_to_swap(tasks[d] if d < len(tasks) else (), stash, resident[d], capacity)
        for d, capacity in enumerate(capacities) if capacity is not None))


def _resident_state(state: dict[int, float], swapped: frozenset[int], depth: int, mine: list[int]) -> float:
    """Training state a device holds at once: all of its stages' that stay, `depth` of the swapped ones'."""
    kept = sum(state[s] for s in mine if s not in swapped)
    moving = sorted((state[s] for s in mine if s in swapped), reverse=True)
    return kept + sum(moving[:depth])


def _stash_in_flight(tasks: Sequence[Task], stash: dict[int, int], swapped: AbstractSet[int] = frozenset(),
                     depth: int = 2) -> float:
    """The most stash bytes a device holds while it runs `tasks` in order: each forward (or recompute)
    of a stage that keeps its stashes holds one until its backward; the stages that swap theirs
    hold at most `depth` of them at a time."""
    live: dict[int, int] = {}
    most = 0.0
    for task in tasks:
        if task.phase is Phase.RECOMPUTE or (task.phase is Phase.FORWARD and task.stash):
            live[task.stage] = live.get(task.stage, 0) + 1
        elif task.phase.ends_stash:
            live[task.stage] = live.get(task.stage, 0) - 1
        most = max(most, sum(n * stash.get(s, 0) for s, n in live.items() if s not in swapped))
    window = depth * max((stash.get(s, 0) for s in swapped), default=0)
    return most + window


def _stashes_to_swap(tasks: Sequence[Task], stash: dict[int, int], resident: float, capacity: int) -> frozenset[int]:
    """A device's stages whose stashes go to host memory: none if its stashes in flight fit beside
    its resident state, else the stages holding the most stash bytes at once, one by one, until they fit."""
    swapped: set[int] = set()
    stages = {t.stage for t in tasks if stash.get(t.stage, 0) > 0}

    def held(stage: int) -> float:
        return _stash_in_flight([t for t in tasks if t.stage == stage], stash)

    for stage in sorted(stages, key=held, reverse=True):
        if resident + _stash_in_flight(tasks, stash, frozenset(swapped)) <= capacity:
            break
        swapped.add(stage)
    return frozenset(swapped)
