"""Moving tensors between the devices of one process: point-to-point mailboxes and all-reduce.

Sends never block (the mailbox holds the tensor until the receiver takes it); a receive or
an all-reduce that cannot complete yet reports "not ready" so the executor can run another
device's program instead of waiting, which is how N devices share one Python thread.
"""

from __future__ import annotations

import torch

Key = tuple  # (what, value, microbatch, src, dst)


class LocalTransport:
    def __init__(self, devices: list[torch.device]):
        self.devices = devices
        self.mailbox: dict[Key, torch.Tensor] = {}
        self.reductions: dict[tuple, dict[int, list[torch.Tensor]]] = {}
        self.taken: dict[tuple, set[int]] = {}
        self.p2p_bytes = [0] * len(devices)

    def send(self, what: str, value: str, microbatch: int, src: int, dst: int, tensor: torch.Tensor) -> None:
        moved = tensor.detach().to(self.devices[dst], non_blocking=True)
        self.p2p_bytes[src] += tensor.numel() * tensor.element_size()
        key = (what, value, microbatch, src, dst)
        if key in self.mailbox and what == "act":
            raise RuntimeError(f"duplicate send of {key}")
        self.mailbox[key] = moved

    def recv(self, what: str, value: str, microbatch: int, src: int, dst: int) -> torch.Tensor | None:
        return self.mailbox.pop((what, value, microbatch, src, dst), None)

    def all_reduce(self, tag: tuple, group: tuple[int, ...], rank: int, tensors: list[torch.Tensor]) -> list[torch.Tensor] | None:
        """Sum `tensors` elementwise over `group`; None until every member has contributed."""
        key = (tag, group)
        contributions = self.reductions.setdefault(key, {})
        contributions.setdefault(rank, [t.detach() for t in tensors])
        if len(contributions) < len(group):
            return None
        device = self.devices[rank]
        result = [sum(c[i].to(device) for c in (contributions[r] for r in group)) for i in range(len(tensors))]
        taken = self.taken.setdefault(key, set())
        taken.add(rank)
        if taken == set(group):
            del self.reductions[key], self.taken[key]
        return result
