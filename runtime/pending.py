"""One issued torch.distributed operation whose completion a thread polls, so that it can give up
on a peer that died or stopped answering instead of blocking in `wait()`."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import torch.distributed as dist

from stagewise.ir.errors import PeerError

POLL_S = 0.05  # how often a waiting thread re-checks its deadline and whether this rank failed


class Pending:
    """One issued send, receive or collective, whose completion the caller polls.

    Gloo's point-to-point works report `is_completed()` only after `wait()` was called, and a
    `wait(timeout)` that expires closes the connection to the peer; so under gloo a daemon thread
    makes the one blocking `wait()` (it returns at once when the peer's socket closes) and the
    caller polls its event. Under NCCL `is_completed()` queries the work's CUDA event directly.
    """

    def __init__(self, work: dist.Work, blocking_wait: bool, what: str, peers: str,
                 on_done: Callable[[], None] | None = None):
        self.work = work
        self.what = what  # the instruction, for errors
        self.peers = peers  # "rank 1" or "ranks 0,1", for errors
        self.error: BaseException | None = None
        self.event: threading.Event | None = None
        self.on_done = on_done  # under gloo: called once finished (a receive wakes who waits on its message)
        if blocking_wait:
            self.event = threading.Event()
            threading.Thread(target=self._wait, args=(self.event,), name=f"wait {what}", daemon=True).start()

    def _wait(self, finished: threading.Event) -> None:
        try:
            self.work.wait()
        except BaseException as error:  # noqa: BLE001 - re-raised by the polling thread
            self.error = error
        finally:
            finished.set()
            if self.on_done is not None:
                self.on_done()

    def done(self, poll_s: float) -> bool:
        """True once the work finished (raising its error as `PeerError`), after waiting up to `poll_s`."""
        if self.event is not None:
            finished = self.event.wait(poll_s)
        else:
            finished = self.work.is_completed()
            if finished:
                try:
                    self.work.wait()
                except BaseException as error:  # noqa: BLE001 - turned into PeerError below
                    self.error = error
            else:
                time.sleep(min(poll_s, 1e-3))
        if finished and self.error is not None:
            raise PeerError(f"{self.what}: {self.peers} failed ({self.error}); see that rank's log") from self.error
        return finished
