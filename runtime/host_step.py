"""The optimizer step of a stage whose update runs on the host (Harmony's CPU update, ZeRO-Offload).

The optimizer steps an fp32 master copy of each parameter in host memory, with the gradients the
program copied there, and keeps its state there: the device pool never holds optimizer state. The
optimizer stays the one built over the stage's parameters (so its state_dict keeps its layout):
for the step each parameter points at its master and host gradient, and back at its device copy after.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from stagewise.runtime.worker import StageWorker


def host_step(worker: StageWorker, optimizer: torch.optim.Optimizer, coefficient: float | None) -> None:
    """Step the fp32 host masters with the host gradients; the state the optimizer makes lives
    beside them. The device copies are refreshed by the program's next swap-in (or, swapped,
    by the next use's)."""
    masters = _host_masters(worker, optimizer)
    device_data = {}
    with torch.no_grad():
        for name, param in worker.params.items():
            grad = worker.host.pop(("grads", name), None)
            device_data[name] = param.data
            param.grad = None
            param.data = masters[name]
            if grad is not None:
                param.grad = grad.to(masters[name].dtype)
                if coefficient is not None:
                    param.grad.mul_(coefficient)
    try:
        optimizer.step()
    finally:
        optimizer.zero_grad(set_to_none=True)
        for name, param in worker.params.items():
            param.data = device_data[name]
            worker.versions[name] = param._version
    worker.pool.release(worker.keys.grads)


def _host_masters(worker: StageWorker, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Each parameter's fp32 master in host memory (`host["weights", name]`, which a swap-in
    copies to the device). Made at the first host step from the current copy: the host copy of
    a swapped-out parameter, else the device's. A device copy written since (load_state_dict)
    is current again, and so is copied over its master."""
    masters = {}
    for name, param in worker.params.items():
        host = worker.host.get(("weights", name))
        resident = param.data.numel() > 0
        if host is None or (resident and worker.on_host and param._version != worker.versions.get(name)):
            host = _to_host(worker, param.data, torch.float32, copy=True)
        elif host.dtype != torch.float32:
            host = _to_host(worker, host, torch.float32, copy=True)
        elif not worker.on_host and resident:
            host.copy_(param.data)  # before the first host step the device copy is the current one
        worker.host[("weights", name)] = masters[name] = host
    if not worker.on_host:
        worker.on_host = True
        _state_to_host(worker, optimizer)
    return masters


def _state_to_host(worker: StageWorker, optimizer: torch.optim.Optimizer) -> None:
    """Optimizer state that sits elsewhere (loaded from a checkpoint onto the device, or parked
    in `host` by it) joins the masters in host memory."""
    names = {id(p): n for n, p in worker.params.items()}
    for param, state in optimizer.state.items():
        for key, value in state.items():
            parked = worker.host.pop(("optimizer", f"{names[id(param)]}.{key}"), None)
            if parked is not None:
                value = parked
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                state[key] = _to_host(worker, value, value.dtype, copy=False)


def _to_host(worker: StageWorker, tensor: torch.Tensor, dtype: torch.dtype, copy: bool) -> torch.Tensor:
    """`tensor` in host memory (pinned on CUDA), as a tensor of its own when `copy`."""
    host = tensor.detach().to("cpu", dtype, copy=copy)
    return host.pin_memory() if worker.device.type == "cuda" and not host.is_pinned() else host
