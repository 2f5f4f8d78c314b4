"""The bytes of a stage's gradients, for the pool's ledger after every backward, counted only when they change.

Counting walks every gradient's storage (views of one storage count once), which cost a small
stage's backward more than its bookkeeping. Backwards after the first of a step accumulate into
the same gradient tensors, so the count is redone only when some parameter's gradient is not
the tensor it was at the last count (created, dropped, replaced): weak references tell, without
keeping a dropped gradient alive, and a new tensor at a dead one's address never matches; a
counted gradient freed (dropped to None) forgets the count through the reference's callback.
"""

from __future__ import annotations

import operator
import weakref
from collections.abc import Callable

import torch

from stagewise.runtime.pool import nbytes

_grad_of = operator.attrgetter("grad")


def _absent() -> None:
    """Stands for a gradient that was None at the last count (a weak reference's call, never alive)."""
    return None


class GradBytes:
    def __init__(self, params: dict[str, torch.nn.Parameter]):
        self.params = list(params.values())
        self.trained = nbytes(p for p in self.params if p.requires_grad)  # every trained gradient's bytes
        # per parameter, a call giving its gradient at the last count while that tensor lives
        self.counted: list[Callable[[], torch.Tensor | None]] | None = None
        self.bytes = 0

    def count(self) -> int:
        """Bytes of the distinct storages of the parameters' current gradients."""
        counted = self.counted
        # iterated in C (map): this runs after every backward
        if counted is not None and all(map(operator.is_, map(operator.call, counted), map(_grad_of, self.params))):
            return self.bytes
        grads = [p.grad for p in self.params]
        self.counted = [_absent if g is None else weakref.ref(g, self._dropped) for g in grads]
        self.bytes = nbytes(g for g in grads if g is not None)
        return self.bytes

    def from_start(self) -> int:
        """What a backward's gradients take from its start: those already made, else every trained one's
        (the simulator's charge; a message arriving meanwhile then waits for room)."""
        return self.count() or self.trained

    def _dropped(self, _: weakref.ref) -> None:
        """A counted gradient was freed: count again (its parameter's gradient may now be None, which
        a dead reference, also giving None, would otherwise match)."""
        self.counted = None
