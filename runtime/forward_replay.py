"""What makes a recompute replay its forward: the same random draws, and no second update of the
buffers the forward writes (BatchNorm's running statistics and num_batches_tracked).

Each forward and recompute runs inside `drawing(seed, step, microbatch)` (ir/random_streams.py),
so the stage's random ops draw the same masks both times. The stage's first forward learns which of
its buffers it writes: from their `_version` (an exported graph `copy_`s into them) and their
values (an fx BatchNorm module's kernel updates the running statistics in place without bumping
their version); a recompute snapshots those
buffers first and puts them back after, so the statistics are those of eager training over the
same microbatches, whatever the schedule recomputes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from stagewise.ir.random_streams import drawing


class ForwardReplay:
    """Per executor: the plan's seed, and per stage the buffers its forward was seen to write."""

    def __init__(self, seed: int):
        self.seed = seed
        self.written: dict[int, set[str]] = {}  # stage -> names of the buffers its forward writes

    def running(self, stage: int, module: torch.nn.Module, microbatch: int, step: int,
                recompute: bool) -> contextlib.AbstractContextManager:
        """Around one forward (or, `recompute`, its replay) of `stage`'s `module` on `microbatch`: the
        draws' key alone, once the stage's writes are known (every forward but the stage's first)."""
        draws = drawing(self.seed, step, microbatch, module.training)
        if recompute:
            return self._replaying(draws, stage, module) if self.written.get(stage) else draws
        if stage in self.written or not module.training:
            return draws
        return self._learning(draws, stage, module)

    @contextlib.contextmanager
    def _learning(self, draws: contextlib.AbstractContextManager, stage: int, module: torch.nn.Module) -> Iterator[None]:
        """The stage's first training forward: versions tell an exported graph's `copy_`, values
        BatchNorm's kernel, which updates the running statistics in place without bumping their
        version. (A forward in eval mode writes none: BatchNorm reads its running statistics, so
        it teaches nothing about the training forwards.)"""
        buffers = dict(module.named_buffers())
        versions = {name: b._version for name, b in buffers.items()}
        values = {name: b.detach().clone() for name, b in buffers.items()}
        with draws:
            yield
        self.written[stage] = {name for name, b in buffers.items()
                               if b._version != versions[name] or not torch.equal(b, values[name])}

    @contextlib.contextmanager
    def _replaying(self, draws: contextlib.AbstractContextManager, stage: int, module: torch.nn.Module) -> Iterator[None]:
        """A recompute of a stage whose forward writes buffers: those are put back after it."""
        buffers = dict(module.named_buffers())
        kept = {name: buffers[name].detach().clone() for name in self.written[stage]}
        try:
            with draws:
                yield
        finally:
            for name, value in kept.items():
                # through .data: the recompute's autograd graph saved BatchNorm's running statistics
                # (unused by a training-mode backward), and a version bump would fail its backward
                buffers[name].data.copy_(value)
