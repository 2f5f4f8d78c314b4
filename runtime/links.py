"""What the ranks of a distributed plan talk over, derived alike on every rank from the plan: the
device groups of its all-reduces, the directed links of its transfers, and the tag of each
message."""

from __future__ import annotations

import torch
import torch.distributed as dist

from stagewise.ir.declared import dtype_named
from stagewise.ir.errors import PlanError
from stagewise.ir.instructions import ALL_REDUCES, Recv, Send, message_keys
from stagewise.ir.plan import Plan


def reduction_groups(plan: Plan) -> list[tuple[int, ...]]:
    """The distinct device groups of every all-reduce of every program, sorted (the creation order).

    An all-reduce instruction lists member stages; the executor reduces over their devices
    (sorted, each once), having summed the stages it holds itself. A group within one device
    needs no process group.
    """
    device_of = {s.index: s.device for s in plan.stages}
    groups = {tuple(sorted({device_of[s] for s in ins.group}))
              for p in plan.programs for ins in p.instructions if isinstance(ins, ALL_REDUCES)}
    return sorted(g for g in groups if len(g) > 1)


def directed_links(plan: Plan) -> list[tuple[int, int]]:
    """(sender, receiver) device pairs of every transfer and its gradient, sorted.

    Each direction gets its own group: under NCCL a group's point-to-point ops run on one
    stream in issue order, and a rank's send and receive threads would interleave differently
    on the two ranks, which can deadlock; one direction has one issuing thread on each side.
    """
    device_of = {s.index: s.device for s in plan.stages}
    links = set()
    for t in plan.transfers:
        src, dst = device_of[t.src], device_of[t.dst]
        if src != dst:
            links.add((src, dst))
            if t.requires_grad:
                links.add((dst, src))
    return sorted(links)


def misordered_links(plan: Plan) -> list[tuple[int, int]]:
    """Directed links whose sender issues its messages in another order than the receiver expects.

    Gloo matches a message to its receive by tag, so the order does not matter; NCCL ignores
    tags and pairs a link's sends and receives in issue order, so there it must agree.
    """
    by_device = {p.device: p for p in plan.programs}
    wrong = []
    for src, dst in directed_links(plan):
        sent = [key for i in by_device[src].instructions if isinstance(i, Send) and i.peer == dst
                for key in message_keys(i)]
        expected = [key for i in by_device[dst].instructions if isinstance(i, Recv) and i.peer == src
                    for key in message_keys(i)]
        if sent != expected:
            wrong.append((src, dst))
    return wrong


def check_link_order(plan: Plan) -> None:
    """A backend that pairs messages in issue order (NCCL) needs every link's orders to agree."""
    wrong = misordered_links(plan)
    if wrong:
        raise PlanError(
            f"devices {wrong} (sender, receiver) issue their messages in another order than the receiver "
            f"expects, which {dist.get_backend()} cannot match (it ignores tags); use the gloo backend or "
            "another schedule"
        )


def transfer_key(key: tuple) -> tuple[str, int, int]:
    """(value, producer stage, consumer stage) of a message: a gradient flows against its transfer."""
    what, value, _, src_stage, dst_stage = key
    return (value, src_stage, dst_stage) if what == "act" else (value, dst_stage, src_stage)


class MessageTags:
    """The tag of each message of a plan, alike on every rank: (transfer, act|grad, microbatch), and
    on the wire the transport's epoch (its failed steps so far) in front, so that a message of a
    failed step can never match a later step's receive."""

    def __init__(self, plan: Plan):
        self.plan = plan
        self.index = {(t.value, t.src, t.dst): i for i, t in enumerate(plan.transfers)}
        self.space = max(1, 2 * len(plan.transfers) * plan.microbatches)  # the tags of one epoch
        # this step's (value, microbatch) -> (sizes, dtype) where they differ from the plan's (a batch of
        # other sizes: compiler/assembly/step_shapes.py); None: the plan's hold
        self.step_specs: dict[tuple[str, int], tuple[tuple[int, ...], torch.dtype]] | None = None

    def of(self, key: tuple) -> int:
        """The tag of message `key` = (what, value, microbatch, src stage, dst stage) within an epoch."""
        what, _, microbatch = key[:3]
        return (self.index[transfer_key(key)] * 2 + (what == "grad")) * self.plan.microbatches + microbatch

    def on_wire(self, tag: int, epoch: int) -> int:
        """`tag` in `epoch` (gloo's tags are 31-bit: epochs repeat after that many failed steps)."""
        return (epoch % max(1, (2**31 - 1) // self.space)) * self.space + tag

    def like(self, tag: int) -> tuple[tuple[int, ...], torch.dtype]:
        """Shape and dtype of the message under `tag` (a gradient is shaped like its activation) this step."""
        transfer = self.plan.transfers[tag // (2 * self.plan.microbatches)]
        spec = None if self.step_specs is None else self.step_specs.get((transfer.value, tag % self.plan.microbatches))
        if spec is not None:
            return spec
        return tuple(transfer.shape), dtype_named(transfer.dtype, f"the plan's transfer of {transfer.value!r}")
