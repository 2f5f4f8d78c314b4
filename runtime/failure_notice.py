"""Telling every rank at once that a step failed on one of them.

A rank whose step raised stops waiting on the network, but its peers would keep waiting for
messages it will never send until their timeout, each blaming a live rank. So the failing rank
posts a notice in the process group's key-value store (a key per transport and step epoch) and
the peers' polling waits look for it: on seeing it a waiting thread fails its rank's step with
`PeerFailed`, and every rank goes on to agree on the failure (`DistributedTransport.conclude`).
A notice costs nothing while no wait lasts longer than one poll, and one store lookup per poll
interval (shared by all of a rank's waiting threads) after that.
"""

from __future__ import annotations

import threading
import time

import torch.distributed as dist
from torch.distributed.distributed_c10d import _get_default_store

from stagewise.runtime.pending import POLL_S
from stagewise.runtime.sync import Aborted


class PeerFailed(Aborted):
    """This rank's step stopped because another rank posted a failure notice: not a failure of
    this rank (it reports the peer's failure, agreed in `conclude`, instead)."""


class FailureNotice:
    """The notices of one transport: `post` once per epoch, `seen` polled by waiting threads."""

    def __init__(self, name: str):
        """`name` is the same on every rank and unique per transport (its world group's name), so
        the notices of two pipelines in one process group never mix."""
        self.store = dist.PrefixStore(f"stagewise/{name}/failed/", _get_default_store())
        self.lock = threading.Lock()
        self.posted: set[int] = set()  # epochs this rank posted a notice for
        self.checked_at = 0.0  # when a waiting thread last asked the store
        self.found: dict[int, str] = {}  # epoch -> the notice seen

    def post(self, epoch: int, description: str) -> None:
        """Tell the other ranks that this rank's step of `epoch` failed (once; best effort: the
        agreement in `conclude` does not depend on it, only how soon the peers stop waiting)."""
        with self.lock:
            if epoch in self.posted:
                return
            self.posted.add(epoch)
        try:
            self.store.set(str(epoch), description)
        except RuntimeError:
            pass  # the store is gone with a dead rank: the peers learn it from their own waits

    def seen(self, epoch: int) -> str | None:
        """The notice another rank posted for `epoch`, if any; the store is asked at most once per
        POLL_S whatever the number of threads asking."""
        with self.lock:
            if epoch in self.found or epoch in self.posted:  # its own notice is no news to this rank
                return self.found.get(epoch)
            now = time.monotonic()
            if now - self.checked_at < POLL_S:
                return None
            self.checked_at = now
        try:
            if not self.store.check([str(epoch)]):
                return None
            description = self.store.get(str(epoch)).decode(errors="replace")
        except RuntimeError:
            return None  # the store is gone: the waits time out on the dead peer as before
        with self.lock:
            self.found[epoch] = description
        return description
