"""One monitor for every blocking wait of the in-process runtime's stream threads.

All waits (an event of another stream, a message in the mailbox, an all-reduce partner) go
through `Sync.wait_until`, so the runtime can tell the three ways a wait ends badly:
a thread failed (every other thread stops with it and the first error is raised), every live
thread is waiting (the programs deadlock: reported at once), or a wait outlasts the timeout
(a peer that never answers). Never a hang.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from stagewise.compiler.errors import PeerError, PlanError


class Aborted(Exception):
    """Raised in a stream thread because another thread failed first."""


class Sync:
    def __init__(self, threads: int, timeout_s: float):
        self.condition = threading.Condition()
        self.alive = threads
        self.version = 0  # bumped by every state change (an event done, a message, a thread ending)
        self.waiters: dict[int, int] = {}  # waiting thread -> the version it last checked against
        self.timeout_s = timeout_s
        self.error: BaseException | None = None

    def wait_until(self, ready: Callable[[], bool], what: str) -> None:
        """Block until `ready()` (evaluated under the lock); `what` names the wait in errors."""
        deadline = time.monotonic() + self.timeout_s
        me = threading.get_ident()
        with self.condition:
            while not ready():
                if self.error is not None:
                    raise Aborted
                self.waiters[me] = self.version
                if len(self.waiters) == self.alive and all(v == self.version for v in self.waiters.values()):
                    self.waiters.pop(me)
                    self._fail(PlanError(f"the device programs wait on each other forever (deadlock) at: {what}"))
                    raise Aborted
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    self.waiters.pop(me)
                    self._fail(PeerError(f"waited {self.timeout_s:.0f} s for {what}: a peer stopped answering"))
                    raise Aborted
                self.condition.wait(min(remaining, 1.0))
                self.waiters.pop(me, None)

    def locked(self):
        """The monitor's lock; call `changed()` before leaving it after a state change."""
        return self.condition

    def changed(self) -> None:
        """Wake every waiter to re-check (caller holds the lock)."""
        self.version += 1
        self.condition.notify_all()

    def thread_done(self) -> None:
        with self.condition:
            self.alive -= 1
            self.changed()

    def fail(self, error: BaseException) -> None:
        with self.condition:
            self._fail(error)

    def _fail(self, error: BaseException) -> None:
        if self.error is None:
            self.error = error
        self.changed()
