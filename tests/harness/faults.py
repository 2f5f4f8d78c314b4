"""Faults injected the way a user's model fails, for the atomic-step tests (tests/test_atomic_step.py)
and the same checks on one thread (tests/test_serial.py): a function in the model (kept a call in the
traced graph by `torch.fx.wrap`) raises in its forward, in the backward of its custom autograd Function,
or in the recompute of its forward, on the n-th call of the step; an optimizer raises in its n-th `step`;
a forward may block until released (a stuck stage)."""

from __future__ import annotations

import copy
import functools
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.fx
import torch.nn as nn
import torch.nn.functional as F

import stagewise as sw
from stagewise.ir.instructions import Recompute
from tests.reference import assert_state_equal, eager_train

MICROBATCHES = 4
X, Y = torch.randn(8, 8), torch.randint(0, 5, (8,))


class Faults:
    """The fault to inject this step: which kind, at its n-th call; counted across stream threads."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.kind: str | None = None
        self.nth = 0
        self.calls = 0
        self.recomputes = False  # the stage with the fault point recomputes: its forwards run without grad
        self.block: threading.Event | None = None  # a forward that waits for this event (a stuck stage)

    def arm(self, kind: str | None, nth: int = 1) -> None:
        self.kind, self.nth, self.calls = kind, nth, 0

    def hit(self, kind: str) -> bool:
        with self.lock:
            if self.kind != kind:
                return False
            self.calls += 1
            return self.calls == self.nth


FAULTS = Faults()


class InjectedBackwardError(KeyError):
    """A user's error type: the pipeline must re-raise it as it is."""


class Probe(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 1.0

    @staticmethod
    def backward(ctx, grad):
        if FAULTS.hit("backward"):
            raise InjectedBackwardError("injected backward failure")
        return grad


def fault_point(x: torch.Tensor) -> torch.Tensor:
    """Raise in a forward or a recompute when armed; pass `x` through a Probe (its backward may raise)."""
    if FAULTS.block is not None:
        FAULTS.block.wait()
    recompute = FAULTS.recomputes and torch.is_grad_enabled()
    if FAULTS.hit("recompute" if recompute else "forward"):
        raise ValueError("injected forward failure")
    return Probe.apply(x)


torch.fx.wrap("fault_point")


class FaultPoint(nn.Module):
    def forward(self, x):
        return fault_point(x)


class FailingSGD(torch.optim.SGD):
    def step(self, closure=None):
        if FAULTS.hit("update"):
            raise RuntimeError("injected optimizer failure")
        return super().step(closure)


class FailingAdamW(torch.optim.AdamW):
    def step(self, closure=None):
        if FAULTS.hit("update"):
            raise RuntimeError("injected optimizer failure")
        return super().step(closure)


SGD = functools.partial(FailingSGD, lr=0.05, momentum=0.9)
EAGER_SGD = functools.partial(torch.optim.SGD, lr=0.05, momentum=0.9)
ADAMW, EAGER_ADAMW = functools.partial(FailingAdamW, lr=0.01), functools.partial(torch.optim.AdamW, lr=0.01)


def model(batchnorm: bool) -> nn.Sequential:
    norm = [nn.BatchNorm1d(16)] if batchnorm else []
    return nn.Sequential(nn.Linear(8, 16), FaultPoint(), nn.Tanh(), *norm, nn.Linear(16, 16), nn.Tanh(),
                         nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 5))


def snapshot(pipe) -> dict:
    """Everything a failed step must leave as it was."""
    workers = pipe._workers
    return {
        "state": {k: v.detach().clone() for k, v in pipe.state_dict().items()},
        "optimizer": [copy.deepcopy(w.optimizer_state()) for w in workers],
        "grads": [(n, p.grad) for w in workers for n, p in w.params.items() if p.grad is not None],
        "host grads": [k for w in workers for k in w.host if k[0] == "grads"],
        "placement": [(n, p.data.numel()) for w in workers for n, p in w.params.items()],
        "host": [sorted(w.host) for w in workers],
        "pools": [pool.stats() for pool in pipe._runtime.pools],
        "transport": (len(pipe._runtime.transport.mailbox), len(pipe._runtime.transport.reductions)),
        "rng": torch.get_rng_state(),
    }


def assert_same(before: dict, after: dict) -> None:
    assert set(before["state"]) == set(after["state"])
    for name, tensor in before["state"].items():
        assert torch.equal(after["state"][name], tensor), name
    assert _flatten(before["optimizer"]) == _flatten(after["optimizer"])
    assert after["grads"] == [] and after["host grads"] == []
    for key in ("placement", "host", "pools", "transport"):
        assert before[key] == after[key], key
    assert torch.equal(before["rng"], after["rng"])


def _flatten(value):
    """Optimizer states as comparable nested lists (tensors by their values)."""
    if isinstance(value, dict):
        return [(k, _flatten(v)) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))]
    if isinstance(value, (list, tuple)):
        return [_flatten(v) for v in value]
    if isinstance(value, torch.Tensor):
        return ("tensor", value.dtype, tuple(value.shape), value.flatten().tolist())
    return value


def fail_once(pipe, kind: str, nth: int, batch) -> BaseException:
    before = snapshot(pipe)
    FAULTS.arm(kind, nth)
    try:
        with pytest.raises(BaseException) as info:
            pipe.step(*batch[0], target=batch[1])
    finally:
        FAULTS.arm(None)
    assert_same(before, snapshot(pipe))
    return info.value


EXPECTED = {"forward": ValueError, "recompute": ValueError, "backward": InjectedBackwardError, "update": RuntimeError}

TWO, FOUR = ["4"], ["3", "5", "7"]  # the fault point in the first stage (its backward comes last)

def rolled_back_as_eager(schedule: str, options: dict, batchnorm: bool) -> None:
    """Each fault in turn (update without optimizer state, forward / backward / recompute at the first, middle
    and last microbatch, an update after another stage's) fails its step, which leaves everything as before;
    the same batch again; at the end the state is eager's."""
    net = model(batchnorm)
    reference = copy.deepcopy(net)
    pipe = sw.compile(net, 2, (X,), loss_fn=F.cross_entropy, example_target=Y, optimizer=SGD,
                      microbatches=MICROBATCHES, schedule=schedule, **options)
    FAULTS.recomputes = any(isinstance(ins, Recompute) and ins.stage == 0 for p in pipe.programs for ins in p.instructions)
    updates = sum(1 for w in pipe._workers if w.optimizer is not None)
    kinds = ["forward", "backward"] + (["recompute"] if FAULTS.recomputes else [])
    faults = [("update", updates)]  # the first step: no optimizer state yet, and it must stay so
    faults += [(kind, nth) for kind in kinds for nth in (1, MICROBATCHES // 2, MICROBATCHES)]
    faults += [("update", 1)]  # another stage's update already ran: it is undone
    batches = [((torch.randn(8, 8),), torch.randint(0, 5, (8,))) for _ in faults]
    for (kind, nth), batch in zip(faults, batches, strict=True):
        error = fail_once(pipe, kind, nth, batch)
        assert type(error) is EXPECTED[kind]
        notes = " ".join(error.__notes__)
        assert "device" in notes and "stage" in notes and "rolled back" in notes
        assert ("microbatch" in notes) if kind != "update" else ("`dev" in notes and "U" in notes)
        pipe.step(*batch[0], target=batch[1])  # the same batch again
    eager_train(reference, batches, loss_fn=F.cross_entropy, optimizer=EAGER_SGD, microbatches=MICROBATCHES)
    assert_state_equal(pipe.state_dict(), reference.state_dict())


def stuck_stage_meets_the_deadline(tmp_path: Path) -> None:
    """A forward that never returns: the step ends at timeout_s, the pipeline is broken until the stage
    returns, then trains on as eager."""
    net = model(batchnorm=False)
    reference = copy.deepcopy(net)
    pipe = sw.compile(net, 2, (X,), loss_fn=F.cross_entropy, example_target=Y, optimizer=SGD,
                      microbatches=MICROBATCHES, schedule="1f1b", split_points=TWO)
    pipe.timeout_s = 2
    FAULTS.recomputes = False
    release = FAULTS.block = threading.Event()
    try:
        start = time.monotonic()
        with pytest.raises(sw.StepTimeoutError, match=r"timeout_s=2 s: `dev0 #\d+ compute +F stage=0 mb=0` was still running"):
            pipe.step(X, target=Y)
        assert time.monotonic() - start < pipe.timeout_s + 5  # the deadline, not the stage, ends the step
        with pytest.raises(sw.PipelineBrokenError, match="F stage=0 mb=0.*has not returned"):
            pipe.step(X, target=Y)
        with pytest.raises(sw.PipelineBrokenError):
            pipe.save(tmp_path / "checkpoint")
    finally:
        FAULTS.block = None
        release.set()
    assert pipe._executor.recovery.stuck.finished.wait(30)
    pipe.step(X, target=Y)
    eager_train(reference, [((X,), Y)], loss_fn=F.cross_entropy, optimizer=EAGER_SGD, microbatches=MICROBATCHES)
    assert_state_equal(pipe.state_dict(), reference.state_dict())
