"""One monitor for every blocking wait of the in-process runtime's stream threads.

All waits (an event of another stream, a message in the mailbox, an all-reduce partner) go
through `Sync.wait_until`, naming the keys whose change could make them ready. A change wakes
only the threads waiting on its keys, so finishing an instruction costs one wake-up, not one
per stream thread. The runtime can still tell the three ways a wait ends badly: a thread
failed (every other thread stops with it and the first error is raised), every live thread
waits on keys that have not changed since it last looked (the programs deadlock: reported at
once), or a wait outlasts the timeout (a peer that never answers). Never a hang.

A wait is on the path of every instruction, so it is built from the cheapest parts: a wait
that is ready returns after one predicate call under the lock; a thread that must block parks
on a lock of its own (a binary semaphore, released by whoever changes one of its keys) rather
than a `threading.Condition`, whose wait and notify run several Python lines and allocate a lock
each time; waiting threads are indexed by key, and the deadlock test is two counters.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Hashable, Sequence

from stagewise.ir.errors import PeerError, PlanError
from stagewise.runtime.step_timing import waited_since

RECHECK_S = 1.0  # a parked thread re-checks its predicate at least this often, whatever it was told


class Aborted(Exception):
    """Raised in a stream thread because another thread failed first."""


class _Waiter:
    """One thread's parking place, reused by all of its waits in a step."""

    __slots__ = ("park", "keys", "waiting", "woken")

    def __init__(self) -> None:
        self.park = threading.Lock()
        self.park.acquire()  # held while nobody woke the thread: acquiring it again parks
        self.keys: Sequence[Hashable] = ()
        self.waiting = False  # registered under `keys`
        self.woken = False  # one of its keys changed (or it must re-check) since it registered


class Sync:
    def __init__(self, threads: int, timeout_s: float):
        self.lock = threading.Lock()
        self.alive = threads
        self.timeout_s = timeout_s
        self.error: BaseException | None = None
        self._threads: dict[int, _Waiter] = {}  # thread ident -> its waiter
        self._by_key: dict[Hashable, list[_Waiter]] = {}  # key -> the registered waiters waiting on it
        self._waiting = 0  # registered waiters
        self._unchanged = 0  # registered waiters none of whose keys changed since they registered
        # the step's error where the programs deadlock, if what they wait for says one (a message no memory
        # will be freed for: runtime/transport.py); else a PlanError naming the last wait
        self.explain: Callable[[], BaseException | None] | None = None

    def wait_until(self, ready: Callable[[], bool], what: str, keys: Sequence[Hashable]) -> None:
        """Block until `ready()` (evaluated under the lock); a change of one of `keys` re-checks it.
        `what` names the wait in errors."""
        with self.lock:
            if not ready():
                began = time.perf_counter()
                try:
                    self._block(ready, what, keys)
                finally:
                    waited_since(began)  # the thread's step clock (runtime/step_timing.py)

    def _block(self, ready: Callable[[], bool], what: str, keys: Sequence[Hashable]) -> None:
        """Park until `ready()`, failing the step on deadlock or timeout (caller holds the lock)."""
        deadline = time.monotonic() + self.timeout_s
        me = self._threads.get(threading.get_ident())
        if me is None:
            me = self._threads[threading.get_ident()] = _Waiter()
        while True:
            if self.error is not None:
                raise Aborted
            self._register(me, keys)
            if self._waiting >= self.alive and self._unchanged == self._waiting:
                self._unregister(me)
                self._fail((self.explain and self.explain())
                           or PlanError(f"the device programs wait on each other forever (deadlock) at: {what}"))
                raise Aborted
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self._unregister(me)
                self._fail(PeerError(f"waited {self.timeout_s:.0f} s for {what}: a peer stopped answering"))
                raise Aborted
            self.lock.release()
            try:
                me.park.acquire(True, min(remaining, RECHECK_S))
            finally:
                self.lock.acquire()
                self._unregister(me)
            if ready():
                return

    def _register(self, me: _Waiter, keys: Sequence[Hashable]) -> None:
        me.keys, me.waiting, me.woken = keys, True, False
        for key in keys:
            waiters = self._by_key.get(key)
            if waiters is None:
                self._by_key[key] = [me]
            else:
                waiters.append(me)
        self._waiting += 1
        self._unchanged += 1

    def _unregister(self, me: _Waiter) -> None:
        """Take `me` off its keys; a wake-up that came after its wait ended (timed out) is consumed here."""
        for key in me.keys:
            waiters = self._by_key[key]
            if len(waiters) == 1:
                del self._by_key[key]
            else:
                waiters.remove(me)
        self._waiting -= 1
        if me.woken:
            me.park.acquire(False)  # one release per wake-up: take it back unless the wait already did
        else:
            self._unchanged -= 1
        me.keys, me.waiting, me.woken = (), False, False

    def _wake(self, waiter: _Waiter) -> None:
        if not waiter.woken:
            waiter.woken = True
            self._unchanged -= 1
            waiter.park.release()

    def locked(self) -> threading.Lock:
        """The monitor's lock; call `changed(key)` before leaving it after a state change."""
        return self.lock

    def changed(self, *keys: Hashable) -> None:
        """Wake the threads waiting on `keys` (caller holds the lock)."""
        for key in keys:
            for waiter in self._by_key.get(key, ()):
                self._wake(waiter)

    def _wake_all(self) -> None:
        for waiter in self._threads.values():
            if waiter.waiting:
                self._wake(waiter)

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
