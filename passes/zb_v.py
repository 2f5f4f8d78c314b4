"""ZB-V (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024, §6 and Fig. 8): two model chunks per
device placed in a V, device d holding stage d and stage 2p - 1 - d, with each backward split into its
input gradient B and its weight gradient W, ordered so that with equal F, B and W the bubble is near zero
while every device keeps 1F1B's peak of activations (2p half-size stashes).

Why a V rather than interleaved's wrap-around: the forward goes down the devices and comes back up, so the
last chunk (and the loss) lands on device 0, which started the pass: the turn at device p - 1 and the
loss's turn at device 0 are local, and each device's two chunks balance each other's memory (chunk 0 holds
its stashes longest, chunk 1 shortest).

The paper gives the order only as its figure; the one here is the figure's as torch.distributed.pipelining
writes it (`ScheduleZBVZeroBubble`, tests/test_zb_v.py compares the two), per device d of p:

- warm-up: 2(p - d) - 1 forwards of chunk 0; d pairs F(chunk 1) F(chunk 0); p - d triples F B W of chunk 1;
- steady state: F, B, W of chunk 0 (no F once every microbatch is in), then F, B, W of chunk 1;
- cool-down: d pairs B(chunk 0) B(chunk 1); p - d pairs B, W of chunk 0; the held-back W of chunk 1, then
  of chunk 0.

The order is written for max(m, 2p - 1) microbatches (fewer cannot fill the V) and the passes of
microbatches beyond m are dropped, which keeps every device's order a valid one (a microbatch's passes
leave together). Each pass of a stage runs in microbatch order, so gradients sum as under 1F1B.
"""

from __future__ import annotations

from stagewise.ir.instructions import Phase
from stagewise.ir.plan import Task


def v_device(stage: int, n_devices: int) -> int:
    """The device of `stage` in the V: stages 0 .. p - 1 down the devices, p .. 2p - 1 back up."""
    return stage if stage < n_devices else 2 * n_devices - 1 - stage


def zb_v(n_devices: int, microbatches: int) -> list[list[Task]]:
    """Each device's tasks over the 2p stages of the V, its two updates last."""
    orders = []
    for d in range(n_devices):
        down, up = d, 2 * n_devices - 1 - d
        padded = _device_order(d, n_devices, max(microbatches, 2 * n_devices - 1))
        order = [task for task in padded if task.microbatch is not None and task.microbatch < microbatches]
        orders.append(order + [Task(Phase.UPDATE, down), Task(Phase.UPDATE, up)])
    return orders


class _Chunk:
    """One of a device's two stages, counting the forwards, input and weight gradients issued."""

    def __init__(self, stage: int) -> None:
        self.stage, self.forwards, self.inputs, self.weights = stage, 0, 0, 0

    def forward(self) -> list[Task]:
        self.forwards += 1
        return [Task(Phase.FORWARD, self.stage, self.forwards - 1)]

    def input_grad(self) -> list[Task]:
        self.inputs += 1
        return [Task(Phase.INPUT_GRAD, self.stage, self.inputs - 1)]

    def weight_grad(self) -> list[Task]:
        self.weights += 1
        return [Task(Phase.WEIGHT_GRAD, self.stage, self.weights - 1)]

    def backward(self) -> list[Task]:
        """B and W back to back: in the steady state W fills no bubble, so it runs at once."""
        return self.input_grad() + self.weight_grad()


def _device_order(d: int, p: int, m: int) -> list[Task]:
    """Device d's order over m >= 2p - 1 microbatches (the module docstring's three phases)."""
    down, up = _Chunk(d), _Chunk(2 * p - 1 - d)
    order: list[Task] = []
    for _ in range(2 * (p - d) - 1):
        order += down.forward()
    for _ in range(d):
        order += up.forward() + down.forward()
    for _ in range(p - d):
        order += up.forward() + up.backward()
    while up.forwards < down.forwards or down.forwards < m:
        order += (down.forward() if down.forwards < m else []) + down.backward()
        order += up.forward() + up.backward()
    for _ in range(d):
        order += down.input_grad() + up.input_grad()
    for _ in range(p - d):
        order += down.input_grad() + down.weight_grad()
    while up.weights < up.inputs:
        order += up.weight_grad()
    while down.weights < down.inputs:
        order += down.weight_grad()
    return order
