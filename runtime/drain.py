"""How a step ends across ranks: agreeing on success or failure, and draining after a failure.

A mixin of `DistributedTransport` (runtime/distributed.py); the executor calls, at the end of
every step, `conclude` (one all-reduce over every rank: the loss sum and a failure flag per rank),
and after an agreed failure `drain`, which completes every operation some rank left half matched
(runtime/step_records.py), gives the transfer buffers back to the pool and starts a new epoch of
message tags and failure notices, so the next step starts clean on every rank. As soon as its
step failed a rank calls `notify_failure` (runtime/failure_notice.py): the others stop waiting.
"""

from __future__ import annotations

import json
from collections.abc import Callable

import torch
import torch.distributed as dist

from stagewise.ir.declared import DTYPES
from stagewise.ir.errors import PeerError
from stagewise.runtime.failure_notice import FailureNotice, PeerFailed
from stagewise.runtime.links import MessageTags
from stagewise.runtime.pending import Pending
from stagewise.runtime.pool import MemoryPool
from stagewise.runtime.step_records import StepRecords, missing_sides
from stagewise.runtime.sync import Aborted
from stagewise.runtime.transport import LocalTransport, StepOutcome, describe_failure

DESCRIPTION_CHARS = 500  # of a failure's description sent to the other ranks
# How long `conclude` waits for the other ranks once this rank's own wait for a peer expired (a
# PeerError): that peer is presumed dead, and the error should not wait a second full timeout.
DEAD_PEER_GRACE_S = 1.0
FAILED_HERE, STOPPED_BY_NOTICE = 2.0, 1.0  # a rank's flag in `conclude`'s all-reduce


class EndOfStep:
    """conclude / drain / notify_failure over the transport's world group, records and receives."""

    rank: int  # global
    device: int  # the pipeline device this rank runs (its pool)
    position: int  # its tensor-parallel position: every position computes the same loss
    pools: list[MemoryPool]
    local: LocalTransport
    world: dist.ProcessGroup
    groups: dict[tuple[int, ...], dist.ProcessGroup]
    links: dict[tuple[int, int], dist.ProcessGroup]
    blocking_wait: bool
    tags: MessageTags
    records: StepRecords
    receives: dict[tuple, tuple[Pending, torch.Tensor]]
    notice: FailureNotice
    epoch: int
    timeout_s: float
    unagreed: str | None = None  # why the last `conclude` did not complete: nothing can be drained
    # DistributedTransport's: start an operation (PeerError if a peer is known dead), poll one to its end
    _issue: Callable[[Callable[[], dist.Work | None], str, str], dist.Work]
    _await: Callable[..., None]

    def notify_failure(self, error: BaseException) -> None:
        """A thread of this rank failed: post a notice so that the other ranks' waits stop now."""
        if not isinstance(error, Aborted):  # a stop caused by another failure is no news
            self.notice.post(self.epoch, f"rank {self.rank}: {describe_failure(error)}"[:DESCRIPTION_CHARS])

    def conclude(self, partial: torch.Tensor | None, failed: BaseException | None) -> StepOutcome:
        """End the step on every rank alike: one all-reduce of the partial loss sums and of a flag per
        rank. Every rank gets the total loss (float64 on the way, so one rank's float32 loss arrives
        bit for bit), or the description of the lowest failing rank's error. A rank that never
        joins is a PeerError, and `drain` then refuses (nothing was agreed)."""
        try:
            outcome = self._agree(partial, failed)
        except PeerError as error:
            self.unagreed = str(error)
            raise
        self.unagreed = None
        return outcome

    def _agree(self, partial: torch.Tensor | None, failed: BaseException | None) -> StepOutcome:
        world = dist.get_world_size(self.world)
        payload = torch.zeros(1 + world, dtype=torch.float64, device=self.pools[self.device].device)
        if partial is not None and failed is None and self.position == 0:  # each position computes the same loss
            payload[0] += partial.detach().double()
        if failed is not None:
            payload[1 + self.rank] = STOPPED_BY_NOTICE if isinstance(failed, PeerFailed) else FAILED_HERE
        deadline_s = DEAD_PEER_GRACE_S if isinstance(failed, PeerError) else self.timeout_s
        self._collect(lambda: dist.all_reduce(payload, group=self.world, async_op=True), "the end of the step",
                      deadline_s)
        flags = payload[1:].tolist()
        if not any(flags):
            self._finish_sends("the end of the step")
            self.records.clear()
            return StepOutcome(loss=payload[0].to(partial.dtype if partial is not None else torch.float32).cpu(),
                               failure=None)
        return StepOutcome(loss=None, failure=self._agreed_failure(flags, failed))

    def _agreed_failure(self, flags: list[float], failed: BaseException | None) -> str:
        """'rank r failed: ...' for the lowest rank whose own step raised (every rank gets the same)."""
        culprit = min((r for r, flag in enumerate(flags) if flag == FAILED_HERE),
                      default=min(r for r, flag in enumerate(flags) if flag))
        mine = describe_failure(failed)[:DESCRIPTION_CHARS] if self.rank == culprit and failed is not None else ""
        return f"rank {culprit} failed: {self._exchange(mine, 'agreeing on the failure')[culprit]}"

    def drain(self) -> None:
        """After an agreed failure: complete every operation of this step some rank left unmatched,
        give the transfer buffers back, and start a new epoch (tags of stale messages never match a
        later step's). A peer that died makes this a PeerError: the transport cannot be made clean."""
        if self.unagreed is not None:
            raise PeerError(f"cannot drain the failed step: the ranks could not agree on it ({self.unagreed})")
        sides = missing_sides(self._exchange(self.records.summary(), "draining the failed step"), self.rank)
        pending = self.records.take_in_flight() + [posted for posted, _ in self.receives.values()]
        pending += [self._placeholder(peer, tag) for peer, tag in sides.placeholders]
        pending += [self._scratch_receive(peer, tag) for peer, tag in sides.scratch]
        pending += [self._zero_reduction(group, numel, dtype) for group, numel, dtype in sides.reductions]
        for operation in pending:
            self._await(operation, f"draining the failed step: `{operation.what}`", abortable=False)
        pool = self.pools[self.device]
        for key, (_, buffer) in self.receives.items():
            pool.give_back_buffer(buffer, ("buffer",) + key)
        self.receives.clear()
        self.local.drain()
        self.records.clear()
        self.epoch += 1

    def _placeholder(self, peer: int, tag: int) -> Pending:
        """Satisfy a receive `peer` posted: zeros of the transfer's shape under its tag."""
        what = f"placeholder for rank {peer}"
        shape, dtype = self.tags.like(tag)
        payload = torch.zeros(shape, dtype=dtype, device=self.pools[self.device].device)
        link, wire = self.links[(self.rank, peer)], self.tags.on_wire(tag, self.epoch)
        work = self._issue(lambda: dist.isend(payload, peer, group=link, tag=wire), what, f"rank {peer}")
        return Pending(work, self.blocking_wait, what, f"rank {peer}")

    def _scratch_receive(self, peer: int, tag: int) -> Pending:
        """Take a message `peer` sent that no receive here was posted for, into a throwaway buffer."""
        what = f"scratch receive from rank {peer}"
        shape, dtype = self.tags.like(tag)
        buffer = torch.empty(shape, dtype=dtype, device=self.pools[self.device].device)
        link, wire = self.links[(peer, self.rank)], self.tags.on_wire(tag, self.epoch)
        work = self._issue(lambda: dist.irecv(buffer, peer, group=link, tag=wire), what, f"rank {peer}")
        return Pending(work, self.blocking_wait, what, f"rank {peer}")

    def _zero_reduction(self, group: tuple[int, ...], numel: int, dtype: str) -> Pending:
        """Complete an all-reduce the other members of `group` entered: contribute zeros of its size."""
        what = "ranks " + ",".join(str(r) for r in group)
        zeros = torch.zeros(numel, dtype=DTYPES[dtype], device=self.pools[self.device].device)
        work = self._issue(lambda: dist.all_reduce(zeros, group=self.groups[group], async_op=True),
                           "completing an all-reduce of the failed step", what)
        return Pending(work, self.blocking_wait, "completing an all-reduce of the failed step", what)

    def _exchange(self, value: object, what: str) -> list:
        """Every rank's `value` (JSON), in rank order, with the transport's deadline (failure path only)."""
        device = self.pools[self.device].device
        data = torch.tensor(list(json.dumps(value).encode()), dtype=torch.uint8, device=device)
        size = torch.tensor([data.numel()], dtype=torch.int64, device=device)
        world = dist.get_world_size(self.world)
        sizes = [torch.zeros_like(size) for _ in range(world)]
        self._collect(lambda: dist.all_gather(sizes, size, group=self.world, async_op=True), what)
        longest = max(int(s.item()) for s in sizes)
        padded = torch.zeros(longest, dtype=torch.uint8, device=device)
        padded[: data.numel()] = data
        parts = [torch.zeros_like(padded) for _ in range(world)]
        self._collect(lambda: dist.all_gather(parts, padded, group=self.world, async_op=True), what)
        return [json.loads(bytes(p[: int(s.item())].cpu().tolist())) for p, s in zip(parts, sizes, strict=True)]

    def _collect(self, start, what: str, timeout_s: float | None = None) -> None:
        """Run a collective of every rank to its end: not stopped by a failure here (every rank is
        past its step), a PeerError when a rank never joins within `timeout_s` (the transport's)."""
        work = self._issue(start, what, "every rank")
        self._await(Pending(work, self.blocking_wait, what, "every rank"), abortable=False, timeout_s=timeout_s)

    def _finish_sends(self, what: str) -> None:
        """Wait until every send this rank issued was delivered (every rank ran its whole program)."""
        for operation in self.records.take_in_flight():
            self._await(operation, f"{what}: delivery of `{operation.what}`", abortable=False)
