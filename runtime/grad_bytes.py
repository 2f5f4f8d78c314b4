"""The bytes of a stage's gradients, for the pool's ledger after every backward, counted only when they change.

Counting walks every gradient's storage (views of one storage count once), which cost a small
stage's backward more than its bookkeeping. Backwards after the first of a step accumulate into
the same gradient tensors, so the count is redone only when some parameter's gradient is not
the tensor it was at the last count (created, dropped, replaced): weak references tell, without
keeping a dropped gradient alive, and a new tensor at a dead one's address never matches.
"""

from __future__ import annotations

import weakref

import torch

from stagewise.runtime.pool import nbytes


class GradBytes:
    def __init__(self, params: dict[str, torch.nn.Parameter]):
        self.params = list(params.values())
        self.counted: list[weakref.ref | None] | None = None  # per parameter, its gradient at the last count
        self.bytes = 0

    def count(self) -> int:
        """Bytes of the distinct storages of the parameters' current gradients."""
        grads = [p.grad for p in self.params]
        counted = self.counted
        if counted is not None and all([(g is None) if ref is None else (ref() is g) for ref, g in zip(counted, grads, strict=True)]):
            return self.bytes
        self.counted = [None if g is None else weakref.ref(g) for g in grads]
        self.bytes = nbytes(g for g in grads if g is not None)
        return self.bytes
