"""A stage's ledger keys and output positions, made once per stage instead of on every forward and backward.

Every forward and backward registers in the device's pool under a key naming the stage (and the
microbatch), and finds its outputs by name: on a small model, building those tuples and searching
the output list per call was a visible part of the runtime's cost above eager (issue 23).
"""

from __future__ import annotations


class StageKeys:
    """The pool keys of stage `stage` (its gradients, each microbatch's stash) and each output's position."""

    def __init__(self, stage: int, outputs: tuple[str, ...]):
        self.stage = stage
        self.grads = ("grads", stage)
        self.output_index = {name: position for position, name in reversed(list(enumerate(outputs)))}  # the first
        self.stashes: dict[int, tuple[str, int, int]] = {}
        self.recorded: dict[int, tuple[str, int, int]] = {}

    def stash(self, microbatch: int) -> tuple[str, int, int]:
        """The key of `microbatch`'s stash: the same tuple every step."""
        key = self.stashes.get(microbatch)
        if key is None:
            key = self.stashes[microbatch] = ("stash", self.stage, microbatch)
        return key

    def weight_grad_inputs(self, microbatch: int) -> tuple[str, int, int]:
        """The key of the gradients a split backward's B recorded for `microbatch`'s W."""
        key = self.recorded.get(microbatch)
        if key is None:
            key = self.recorded[microbatch] = ("weight-grad-inputs", self.stage, microbatch)
        return key
