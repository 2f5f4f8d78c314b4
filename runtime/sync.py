"""One monitor for every blocking wait of the in-process runtime's stream threads.

All waits (an event of another stream, a message in the mailbox, an all-reduce partner) go
through `Sync.wait_until`, naming the keys whose change could make them ready. A change wakes
only the threads waiting on its keys, so finishing an instruction costs one wake-up, not one
per stream thread. The runtime can still tell the three ways a wait ends badly: a thread
failed (every other thread stops with it and the first error is raised), every live thread
waits on keys that have not changed since it last looked (the programs deadlock: reported at
once), or a wait outlasts the timeout (a peer that never answers). Never a hang.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from collections.abc import Callable, Hashable, Sequence

from stagewise.ir.errors import PeerError, PlanError


class Aborted(Exception):
    """Raised in a stream thread because another thread failed first."""


class Sync:
    def __init__(self, threads: int, timeout_s: float):
        self.lock = threading.Lock()
        self.alive = threads
        self.versions: dict[Hashable, int] = defaultdict(int)  # key -> how often it changed
        self.waiters: dict[int, tuple[threading.Condition, dict[Hashable, int]]] = {}  # thread -> (its condition, keys seen)
        self.conditions: dict[int, threading.Condition] = {}
        self.timeout_s = timeout_s
        self.error: BaseException | None = None

    def wait_until(self, ready: Callable[[], bool], what: str, keys: Sequence[Hashable]) -> None:
        """Block until `ready()` (evaluated under the lock); a change of one of `keys` re-checks it.
        `what` names the wait in errors."""
        deadline = time.monotonic() + self.timeout_s
        me = threading.get_ident()
        with self.lock:
            condition = self.conditions.setdefault(me, threading.Condition(self.lock))
            while not ready():
                if self.error is not None:
                    raise Aborted
                self.waiters[me] = (condition, {k: self.versions[k] for k in keys})
                if self._deadlocked():
                    self.waiters.pop(me)
                    self._fail(PlanError(f"the device programs wait on each other forever (deadlock) at: {what}"))
                    raise Aborted
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    self.waiters.pop(me)
                    self._fail(PeerError(f"waited {self.timeout_s:.0f} s for {what}: a peer stopped answering"))
                    raise Aborted
                condition.wait(min(remaining, 1.0))
                self.waiters.pop(me, None)

    def _deadlocked(self) -> bool:
        """Every live thread waits, and none of the keys it waits on changed since it looked."""
        return len(self.waiters) >= self.alive and all(
            all(self.versions[k] == v for k, v in seen.items()) for _, seen in self.waiters.values()
        )

    def locked(self):
        """The monitor's lock; call `changed(key)` before leaving it after a state change."""
        return self.lock

    def changed(self, *keys: Hashable) -> None:
        """Wake the threads waiting on `keys` (caller holds the lock)."""
        for key in keys:
            self.versions[key] += 1
        for condition, seen in self.waiters.values():
            if any(key in seen for key in keys):
                condition.notify()

    def _wake_all(self) -> None:
        for condition, _ in self.waiters.values():
            condition.notify()

    def thread_done(self) -> None:
        with self.lock:
            self.alive -= 1
            self._wake_all()  # the others re-check: with one thread fewer they may be deadlocked

    def fail(self, error: BaseException) -> None:
        with self.lock:
            self._fail(error)

    def _fail(self, error: BaseException) -> None:
        if self.error is None:
            self.error = error
        self._wake_all()
