"""PipeDream-2BW's double-buffered weights (Narayanan §3.2.1): two versions of each trained weight.

The stage module's parameters hold the version a step's forwards and backwards use, W(t-1) during
step t, so a microbatch's forward and backward see the same weights; `newest` holds W(t). The
update applies the gradients computed at W(t-1) to W(t):

    W(t+1) = W(t) - lr * grad f(W(t-1))        (§3.2.1 "Semantics"; any optimizer's rule alike)

after which the parameters hold W(t), the version the next step uses, and `newest` holds W(t+1).
W(t-1) is no longer needed by then (the paper's "discarded"), so two versions are all there is.
Both start as the weights compile was given: the first two steps compute at W(0).

During the optimizer step each parameter points at its newest version (as runtime/host_step.py
points it at its master), so the optimizer state stays keyed by the parameter and the step writes
W(t+1) in place; the parameter's own tensor, first given a copy of W(t), is pointed back after.
Neither tensor is replaced, which keeps a failed step's undo record (runtime/undo.py records both)
and addresses captured by CUDA graphs valid. Frozen parameters never change: one version.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from stagewise.ir.errors import PlanError
from stagewise.runtime.pool import MemoryPool, nbytes


class WeightVersions:
    """A stage's newest weight versions; empty (one version, a plain optimizer step) unless `keep` ran."""

    def __init__(self) -> None:
        self.newest: dict[str, torch.Tensor] = {}  # trained parameter name -> W(t), one step ahead of it

    def keep(self, params: Mapping[str, torch.nn.Parameter], pool: MemoryPool, stage: int, swapped: bool) -> None:
        """Start double-buffering: `newest` a copy of each trained parameter, counted in the device's pool."""
        if swapped:
            raise PlanError(f"stage {stage} swaps its weights to host memory, which 2bw (two weight versions on the "
                            "device) does not support: plan it without swapping, or use a synchronous schedule")
        self.newest = {name: p.detach().clone() for name, p in params.items() if p.requires_grad}
        pool.allocate("weights", ("newest weights", stage), nbytes(self.newest.values()), f"load stage {stage}")

    def match(self, params: Mapping[str, torch.nn.Parameter]) -> None:
        """Both versions the parameters' values, as at the start (after weights are loaded into them)."""
        with torch.no_grad():
            for name, newest in self.newest.items():
                newest.copy_(params[name])

    def step(self, optimizer: torch.optim.Optimizer, params: Mapping[str, torch.nn.Parameter]) -> None:
        """The optimizer step: on the parameters themselves with one version, else on the newest with
        the gradients the parameters hold (module docstring)."""
        if not self.newest:
            optimizer.step()
            return
        used: dict[str, torch.Tensor] = {}
        try:
            with torch.no_grad():
                for name, newest in self.newest.items():
                    param = params[name]
                    used[name] = param.data
                    param.data.copy_(newest)  # W(t-1), no longer needed, becomes W(t): what the next step uses
                    param.data = newest
            optimizer.step()  # W(t) -> W(t+1) in `newest`, with grad f(W(t-1))
        finally:
            for name, data in used.items():
                params[name].data = data
