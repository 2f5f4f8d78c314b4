"""Moving tensors between devices that live in different processes (torch.distributed).

One process per device, launched with torchrun: gloo on CPU, NCCL on CUDA. The executor calls
this transport exactly as it calls `LocalTransport`; a send becomes `isend`, a receive `irecv`
into a buffer from this device's memory pool, and an all-reduce one collective over a process
group created up front. Every wait polls, so a peer that died or stopped answering becomes a
`PeerError` naming the instruction and the peer within `timeout_s`, and a thread of this rank
that failed first makes the others stop quietly (`Aborted`) instead of waiting on the network.
`barrier`, `gather_to_first` and `from_first` serve what every rank does together outside the
programs (saving a checkpoint).

A failed step is undone on every rank (runtime/drain.py): the failing rank posts a failure
notice in the process group's store, which the other ranks' waits poll, so they stop at once
(runtime/failure_notice.py); every step ends with one all-reduce over every rank of the loss
sum and a failure flag per rank (`conclude`), so all agree on success or on which rank failed;
after a failure every rank `drain`s: the ranks exchange what each issued and posted during the
step (runtime/step_records.py) and complete the other side of what was left half matched, then
a new epoch of message tags begins. A rank that died makes this a `PeerError` (the pipeline is
then broken).
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from typing import TypeVar

import torch
import torch.distributed as dist

from stagewise.ir.errors import CapacityError, PeerError, PlanError
from stagewise.ir.plan import Plan
from stagewise.ir.tensor_parallel import RankLayout
from stagewise.runtime.drain import EndOfStep
from stagewise.runtime.failure_notice import FailureNotice, PeerFailed
from stagewise.runtime.links import (
    MessageTags,
    check_link_order,
    directed_links,
    reduction_groups,
)
from stagewise.runtime.pending import POLL_S, Pending
from stagewise.runtime.pool import MemoryPool
from stagewise.runtime.step_records import StepRecords
from stagewise.runtime.step_timing import waited_since
from stagewise.runtime.sync import Aborted, Sync
from stagewise.runtime.transport import LocalTransport

T = TypeVar("T")

# What the ranks execute together and must agree on. Not the planner's predictions: each rank
# measures its own layer costs, so predicted times differ between ranks in the last digits.
EXECUTED_FIELDS = ("devices", "input_names", "input_kind", "target_name", "graph_inputs", "microbatches",
                   "microbatch_size", "schedule", "shared", "stages", "transfers", "programs", "state_names",
                   "aliases", "seed")


class DistributedTransport(EndOfStep):
    """The `LocalTransport` interface over torch.distributed, for global rank `rank`, which runs
    one pipeline device at one tensor-parallel position (`plan.rank_layout()`); the end of a step
    (conclude, drain, notify_failure) is in runtime/drain.py.

    The executor names devices; the transport turns each into the rank of that device at this
    rank's position, so each position is a pipeline of its own: p2p and data-parallel all-reduces
    stay among ranks of one position, the stage's own all-reduces (generated code) run on
    `tensor_group`. Records and the end-of-step collectives use global ranks, over every rank."""

    def __init__(self, plan: Plan, rank: int, pools: list[MemoryPool], timeout_s: float):
        self.layout = plan.rank_layout()
        _check_world(self.layout, rank)
        self.plan = plan
        self.rank = rank
        self.device = self.layout.device_of(rank)  # the pipeline device this rank runs
        self.position = self.layout.position_of(rank)
        self.pools = pools
        self.timeout_s = timeout_s
        self.local = LocalTransport(pools)  # two stages of one device exchange in memory
        self._sync: Sync | None = None
        self.device_of = {s.index: s.device for s in plan.stages}
        self.blocking_wait = dist.get_backend() == "gloo"
        if not self.blocking_wait:
            check_link_order(plan)
        self.records = StepRecords()  # this step's sends, receives and collectives (runtime/step_records.py)
        self.epoch = 0  # failed steps so far: part of every tag and failure notice
        self.tags = MessageTags(plan)
        self.receives: dict[tuple, tuple[Pending, torch.Tensor]] = {}  # posted, not yet taken: key -> (work, buffer)
        self.receives_lock = threading.Lock()
        self.issue_lock = threading.Lock()  # one thread at a time starts an op (receives come from two threads)
        # dist.new_group is collective: every rank creates the same groups in the same order.
        everyone = list(range(self.layout.world_size))
        self.world = dist.new_group(everyone)
        self.checkpoints = dist.new_group(everyone, backend="gloo")  # DCP's CPU collectives
        positions = range(self.layout.degree)
        self.groups = {group: dist.new_group(list(group)) for group in
                       (self._ranks(devices, t) for devices in reduction_groups(plan) for t in positions)}
        pairs = [(self.layout.rank(src, t), self.layout.rank(dst, t)) for src, dst in directed_links(plan) for t in positions]
        self.links = {pair: dist.new_group(sorted(pair)) for pair in pairs}
        tensor_groups = [dist.new_group(list(self.layout.ranks_of(d))) if self.layout.degree > 1 else None
                         for d in range(self.layout.devices)]
        self.tensor_group = tensor_groups[self.device]  # this device's stage group (None: one rank)
        self.tensor_ranks = self.layout.ranks_of(self.device)
        if self.tensor_group is not None:  # the drain completes its sums as it does the other all-reduces
            self.groups[self.tensor_ranks] = self.tensor_group
        self.notice = FailureNotice(self.world.group_name)  # the same name on every rank
        self._check_same_plan()

    # ---- the executor's interface -----------------------------------------------------------
    @property
    def transfer_specs(self) -> dict | None:
        """This step's sizes of the values sent, where they differ from the plan's (compiler/assembly/step_shapes.py)."""
        return self.tags.step_specs

    @transfer_specs.setter
    def transfer_specs(self, specs: dict | None) -> None:
        self.tags.step_specs = specs

    @property
    def sync(self) -> Sync | None:
        return self._sync

    @sync.setter
    def sync(self, sync: Sync | None) -> None:
        """The executor installs a fresh monitor per iteration; the in-memory path shares it."""
        self._sync = sync
        self.local.sync = sync

    def send(self, key: tuple, src_device: int, dst_device: int, tensor: torch.Tensor, instruction: str) -> None:
        """key = (what, value, microbatch, src stage, dst stage). Issues the send and returns at once."""
        if dst_device == src_device:
            self.local.send(key, src_device, dst_device, tensor, instruction)
            return
        self.records.reap()
        _check_shape(tensor, self.tags.like(self.tags.of(key)), key, instruction)
        payload = tensor.detach().contiguous()
        peer = self.layout.rank(dst_device, self.position)
        link = self.links[(self.rank, peer)]
        tag = self.tags.of(key)
        wire = self.tags.on_wire(tag, self.epoch)
        work = self._issue(lambda: dist.isend(payload, peer, group=link, tag=wire), instruction, f"rank {peer}")
        self.pools[src_device].count_sent(payload.numel() * payload.element_size())
        # the compute thread may send too (a forward run early): the records take a lock
        self.records.send(peer, tag, Pending(work, self.blocking_wait, instruction, f"rank {peer}"))

    def recv(self, key: tuple, instruction: str) -> torch.Tensor:
        """The tensor sent under `key`, in a transfer buffer of this device's pool (received into the
        buffer `poll` posted, if it did)."""
        if self.device_of[key[3]] == self.device:
            return self.local.recv(key, instruction)
        pending, buffer = self._post(key, instruction)
        self._await(pending)  # when the step fails, the receive stays posted: `drain` completes it
        with self.receives_lock:
            self.receives.pop(key)
        return buffer

    # Varuna's opportunistic policy (runtime/opportunistic.py) takes a receive over from the p2p_in thread.
    # Gloo matches a message to its receive by tag, so a receive may be posted ahead of its turn and
    # by another thread; NCCL pairs a link's operations in issue order, so there the policy is off.
    @property
    def adopts_receives(self) -> bool:
        return self.blocking_wait

    in_memory = False  # a receive waits on the network: the p2p streams keep their threads (runtime/threadless.py)

    def arrived(self, key: tuple) -> bool:
        """Whether the message under `key` is here: its receive was posted and has finished. Never blocks,
        posts nothing (the thread that owns the receive posts it)."""
        if self.device_of[key[3]] == self.device:
            return self.local.arrived(key)
        with self.receives_lock:
            posted = self.receives.get(key)
        return posted is not None and posted[0].done(0.0)

    def poll(self, key: tuple, instruction: str) -> bool:
        """Post the receive of `key` now if it was not (the caller owns that receive; `recv` takes it
        later) and tell whether its message has arrived. Where the buffer does not fit in the pool
        yet, nothing is posted: not arrived."""
        if self.device_of[key[3]] == self.device:
            return self.local.poll(key, instruction)
        try:
            pending, _ = self._post(key, instruction)
        except CapacityError:
            return False
        return pending.done(0.0)

    def _post(self, key: tuple, instruction: str) -> tuple[Pending, torch.Tensor]:
        """The receive of `key`, posted once: an irecv into a transfer buffer of this device's pool."""
        with self.receives_lock:
            if key in self.receives:
                return self.receives[key]
            peer = self.layout.rank(self.device_of[key[3]], self.position)
            shape, dtype = self.tags.like(self.tags.of(key))
            like = torch.empty(shape, dtype=dtype, device="meta")
            pool = self.pools[self.device]
            buffer = pool.take_buffer(like, ("buffer",) + key, instruction)
            link = self.links[(peer, self.rank)]
            tag = self.tags.of(key)
            wire = self.tags.on_wire(tag, self.epoch)
            try:
                work = self._issue(lambda: dist.irecv(buffer, peer, group=link, tag=wire), instruction, f"rank {peer}")
            except BaseException:
                pool.release(("buffer",) + key)
                raise
            self.records.receive(peer, tag)
            pending = Pending(work, self.blocking_wait, instruction, f"rank {peer}",
                               on_done=lambda: self._arrived_now(key))
            self.receives[key] = (pending, buffer)
            return pending, buffer

    def _arrived_now(self, key: tuple) -> None:
        """Wake the threads of this rank that wait on the message (as an in-process send does)."""
        sync = self._sync
        if sync is not None:
            with sync.locked():
                sync.changed(("message", key))

    def all_reduce(self, tag: tuple, group: tuple[int, ...], rank: int, tensors: list[torch.Tensor],
                   instruction: str) -> list[torch.Tensor]:
        """Sum `tensors` over the group's devices (their ranks at this position); every member gets the
        same bits (one collective per dtype)."""
        if len(set(group)) == 1:
            return self.local.all_reduce(tag, group, rank, tensors, instruction)
        group = self._ranks(group, self.position)
        peers = "ranks " + ",".join(str(r) for r in group)
        buckets = {}
        for dtype in dict.fromkeys(t.dtype for t in tensors):
            flat = torch.cat([t.detach().reshape(-1) for t in tensors if t.dtype == dtype])
            work = self._issue(lambda flat=flat: dist.all_reduce(flat, group=self.groups[group], async_op=True),
                               instruction, peers)
            buckets[dtype] = (flat, Pending(work, self.blocking_wait, instruction, peers))
            self.records.collective(group, flat.numel(), str(dtype).removeprefix("torch."), buckets[dtype][1])
        for _, pending in buckets.values():
            self._await(pending)
        return _unflatten(tensors, {dtype: flat for dtype, (flat, _) in buckets.items()})

    def _ranks(self, devices: tuple[int, ...], position: int) -> tuple[int, ...]:
        """The global ranks running `devices` at tensor-parallel `position`, in the devices' order."""
        return tuple(self.layout.rank(d, position) for d in devices)

    def wait_stage_sum(self, work: dist.Work, total: torch.Tensor) -> None:
        """A split stage's f or g (ir/tensor_parallel_ops.py), issued on `tensor_group`: recorded and
        waited for as this transport's own all-reduces are (stopped when the step failed)."""
        peers = "ranks " + ",".join(str(r) for r in self.tensor_ranks)
        pending = Pending(work, self.blocking_wait, "a split stage's all-reduce", peers)
        self.records.collective(self.tensor_ranks, total.numel(), str(total.dtype).removeprefix("torch."), pending)
        self._await(pending)

    # ---- waiting -----------------------------------------------------------------------------
    def _await(self, pending: Pending, what: str | None = None, abortable: bool = True,
               timeout_s: float | None = None) -> None:
        """Poll until done; `PeerError` after `timeout_s` (the transport's unless given); if `abortable`
        (a wait within the step), `Aborted` when another thread here failed or another rank posted a
        failure notice."""
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        start, began = time.monotonic(), time.perf_counter()
        while not pending.done(POLL_S):
            if abortable:
                self._stop_if_failed()
            waited = time.monotonic() - start
            if waited > timeout_s:
                raise PeerError(
                    f"{what or pending.what}: waited {waited:.1f} s for {pending.peers}, which died or stopped "
                    f"answering (timeout {timeout_s:g} s). Check that rank's log; if it is only slow, "
                    "raise the timeout."
                )
        waited_since(began)  # blocked on a peer: the thread's step clock (runtime/step_timing.py)

    def _stop_if_failed(self) -> None:
        """`Aborted` once this step failed here or on another rank (whose notice fails this rank's
        step with `PeerFailed`, so that every thread of the rank stops, not only this one)."""
        sync = self._sync
        if sync is not None and sync.error is not None:
            raise Aborted
        notice = self.notice.seen(self.epoch)
        if notice is not None:
            if sync is not None:
                sync.fail(PeerFailed(notice))
            raise Aborted

    def _issue(self, start, instruction: str, peers: str) -> dist.Work:
        """Start a torch.distributed op; a peer already known dead makes gloo raise right here."""
        try:
            with self.issue_lock:
                return start()
        except RuntimeError as error:
            raise PeerError(f"{instruction}: cannot reach {peers} ({error}); see that rank's log") from error

    # ---- every rank at once (saving a checkpoint) ---------------------------------------------
    def barrier(self, what: str, advice: str) -> None:
        """Wait up to `timeout_s` for every rank to get here; a rank that never does is a PeerError
        saying `what` waited and the `advice`, not a wait for the process group's timeout."""
        work = self._issue(lambda: dist.barrier(group=self.world, async_op=True), what, "every rank")
        pending = Pending(work, self.blocking_wait, what, "every rank")
        start = time.monotonic()
        while not pending.done(POLL_S):
            if time.monotonic() - start > self.timeout_s:
                raise PeerError(f"{what}: waited {self.timeout_s:g} s for the other ranks; {advice}")

    def gather_to_first(self, value: object, group: dist.ProcessGroup | None = None) -> list | None:
        """Every rank's `value`, in rank order, on rank 0 (None on the others); over `group` (one of
        every rank: `checkpoints` for a save's thread), by default the world group."""
        group = group or self.world
        gathered = [None] * dist.get_world_size(group) if self.rank == 0 else None
        dist.gather_object(value, gathered, dst=0, group=group)
        return gathered

    def from_first(self, value: T, group: dist.ProcessGroup | None = None) -> T:
        """Rank 0's `value`, on every rank (over `group`, as `gather_to_first`)."""
        box = [value]
        dist.broadcast_object_list(box, src=0, group=group or self.world)
        return box[0]

    # ---- naming ------------------------------------------------------------------------------
    def _check_same_plan(self) -> None:
        """Every rank compiled on its own: different plans would exchange garbage or hang, so compare
        what they execute (EXECUTED_FIELDS)."""
        data = json.loads(self.plan.to_json())  # the programs in their printed form
        executed = json.dumps({name: data[name] for name in EXECUTED_FIELDS})
        digest = int.from_bytes(hashlib.sha256(executed.encode()).digest()[:7], "big")
        values = [torch.tensor([digest], dtype=torch.int64, device=self.pools[self.device].device) for _ in range(2)]
        for value, op in zip(values, (dist.ReduceOp.MIN, dist.ReduceOp.MAX), strict=True):
            work = self._issue(lambda value=value, op=op: dist.all_reduce(value, op, group=self.world, async_op=True),
                               "comparing plans", "the other ranks")
            self._await(Pending(work, self.blocking_wait, "comparing plans", "the other ranks"))
        if values[0].item() != values[1].item():
            raise PlanError(
                "the ranks compiled different plans; compile with the same model, seed, inputs and options "
                "on every rank (or compile on rank 0 and load the saved pipeline everywhere)"
            )


def _check_world(layout: RankLayout, rank: int) -> None:
    if not dist.is_initialized():
        raise PlanError("the distributed transport needs torch.distributed initialised (launch with torchrun)")
    world = dist.get_world_size()
    if world != layout.world_size or dist.get_rank() != rank:
        raise PlanError(
            f"the plan has {layout.devices} devices of {layout.degree} rank(s) each but this is rank "
            f"{dist.get_rank()} of {world} processes asked to run rank {rank}; launch one process per device "
            f"and tensor-parallel rank (torchrun --nproc-per-node {layout.world_size})"
        )


def _check_shape(tensor: torch.Tensor, expected: tuple[tuple[int, ...], torch.dtype], key: tuple,
                 instruction: str) -> None:
    """The receiver allocates from the shape it expects (the plan's, or this step's: compiler/assembly/step_shapes.py);
    a different tensor would arrive corrupted."""
    shape, dtype = expected
    if tuple(tensor.shape) != tuple(shape) or tensor.dtype != dtype:
        raise PlanError(
            f"{instruction}: {key[0]} of `{key[1]}` is {tuple(tensor.shape)} {tensor.dtype} but its receiver expects "
            f"{tuple(shape)} {dtype}; a stage's code gave another shape than its fake run did: report it"
        )


def _unflatten(tensors: list[torch.Tensor], flats: dict[torch.dtype, torch.Tensor]) -> list[torch.Tensor]:
    """Views of the reduced buffers, shaped and ordered like `tensors`."""
    offsets = dict.fromkeys(flats, 0)
    result = []
    for t in tensors:
        start = offsets[t.dtype]
        result.append(flats[t.dtype][start : start + t.numel()].view(t.shape))
        offsets[t.dtype] = start + t.numel()
    return result
