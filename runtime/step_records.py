"""What one rank put in flight during a step, and what it must add to leave nothing in flight.

Under torch.distributed a failed step leaves operations half matched: receives posted for
messages their sender never sent, sends no receive was posted for, all-reduces only some members
of a group entered. Each rank records this step's issued sends and posted receives (by peer and
message tag, in issue order) and the collectives it entered (by group, with their sizes). After
an agreed failure the ranks exchange their records and each completes its side of every
operation a peer started (`missing_sides`): a placeholder send for each receive a peer posted, a
scratch receive for each send a peer issued, a zero contribution to each collective a peer
entered. A successful step forgets its records (`clear`).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from stagewise.runtime.pending import Pending

Group = tuple[int, ...]


@dataclass
class StepRecords:
    """This rank's operations of the current step; any stream thread records, under `lock`."""

    sent: dict[int, list[int]] = field(default_factory=dict)  # peer -> tags of sends issued to it
    posted: dict[int, list[int]] = field(default_factory=dict)  # peer -> tags of receives posted from it
    collectives: dict[Group, list[tuple[int, str]]] = field(default_factory=dict)  # group -> (numel, dtype)
    in_flight: list[Pending] = field(default_factory=list)  # sends and collectives not known finished
    lock: threading.Lock = field(default_factory=threading.Lock)

    def send(self, peer: int, tag: int, pending: Pending) -> None:
        with self.lock:
            self.sent.setdefault(peer, []).append(tag)
            self.in_flight.append(pending)

    def receive(self, peer: int, tag: int) -> None:
        with self.lock:
            self.posted.setdefault(peer, []).append(tag)

    def collective(self, group: Group, numel: int, dtype: str, pending: Pending) -> None:
        with self.lock:
            self.collectives.setdefault(group, []).append((numel, dtype))
            self.in_flight.append(pending)

    def reap(self) -> None:
        """Forget the operations that finished, so the list stays short; a failed one raises here."""
        with self.lock:
            pending = list(self.in_flight)
        finished = [p for p in pending if p.done(0.0)]
        with self.lock:
            self.in_flight = [p for p in self.in_flight if p not in finished]

    def take_in_flight(self) -> list[Pending]:
        with self.lock:
            pending, self.in_flight = self.in_flight, []
        return pending

    def clear(self) -> None:
        """The step ended with every operation matched: nothing to remember."""
        with self.lock:
            self.sent, self.posted, self.collectives, self.in_flight = {}, {}, {}, []

    def summary(self) -> dict:
        """The records as the other ranks need them (plain lists: sent as JSON)."""
        with self.lock:
            return {"sent": [[peer, tags] for peer, tags in self.sent.items()],
                    "posted": [[peer, tags] for peer, tags in self.posted.items()],
                    "collectives": [[list(group), [list(c) for c in done]] for group, done in self.collectives.items()]}


@dataclass(frozen=True)
class MissingSides:
    """What this rank adds so every operation of the failed step is matched."""

    placeholders: list[tuple[int, int]]  # (peer, tag): a receive the peer posted that this rank never sent
    scratch: list[tuple[int, int]]  # (peer, tag): a send the peer issued that this rank never received
    reductions: list[tuple[Group, int, str]]  # (group, numel, dtype): collectives other members entered


def missing_sides(summaries: list[dict], rank: int) -> MissingSides:
    """From every rank's `summary` (in rank order), the operations `rank` must issue; in the order
    the peer issued its side (a backend that pairs by order, as NCCL, then pairs them right)."""
    mine = _by_peer(summaries[rank])
    placeholders, scratch = [], []
    for peer, summary in enumerate(summaries):
        if peer == rank:
            continue
        theirs = _by_peer(summary)
        sent_to_them = set(mine["sent"].get(peer, ()))
        placeholders += [(peer, tag) for tag in theirs["posted"].get(rank, ()) if tag not in sent_to_them]
        received_from_them = set(mine["posted"].get(peer, ()))
        scratch += [(peer, tag) for tag in theirs["sent"].get(rank, ()) if tag not in received_from_them]
    entered = {tuple(group): [tuple(c) for c in done] for group, done in summaries[rank]["collectives"]}
    longest: dict[Group, list[tuple[int, str]]] = {}
    for summary in summaries:
        for group, done in summary["collectives"]:
            if rank in group and len(done) > len(longest.get(tuple(group), [])):
                longest[tuple(group)] = [tuple(c) for c in done]
    reductions = [(group, numel, dtype) for group, done in longest.items()
                  for numel, dtype in done[len(entered.get(group, [])):]]
    return MissingSides(placeholders, scratch, reductions)


def _by_peer(summary: dict) -> dict[str, dict[int, list[int]]]:
    return {what: {peer: tags for peer, tags in summary[what]} for what in ("sent", "posted")}
