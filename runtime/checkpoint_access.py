"""A stage's optimizer state as a checkpoint reads and writes it, wherever it lives.

A swapped stage keeps its optimizer state in host memory between steps (the device holds empty
tensors then), and a stage whose optimizer steps on the host keeps it there for good; a
checkpoint must neither know that nor reach into the worker for it. `StageWorker` inherits
these methods (its parameters' values: `StageWorker.state_tensors`).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator

import torch


class CheckpointAccess:
    """Mixed into `StageWorker` (runtime/worker.py), whose attributes these are."""

    optimizer: torch.optim.Optimizer | None
    params: dict[str, torch.nn.Parameter]
    host: dict[tuple[str, str], torch.Tensor]  # (what, name) -> host copy
    device: torch.device
    swapped: bool

    @contextlib.contextmanager
    def weights_in_place(self) -> Iterator[None]:
        """While inside, a swapped-out parameter's data is its host copy (so its shape and values can
        be read through the module, e.g. to describe it); afterwards empty on the device again."""
        parked = {}
        for name, param in self.params.items():
            host = self.host.get(("weights", name))
            if param.numel() == 0 and host is not None and host.numel() > 0:
                parked[name] = param.data
                param.data = host
        try:
            yield
        finally:
            for name, empty in parked.items():
                self.params[name].data = empty

    def optimizer_state(self) -> dict | None:
        """The optimizer's state_dict with CPU tensors, state parked in host memory read from there;
        None for a stage without parameters."""
        if self.optimizer is None:
            return None
        state = self.optimizer.state_dict()
        order = [p for group in self.optimizer.param_groups for p in group["params"]]
        names = {id(p): n for n, p in self.params.items()}
        tensors: dict[int, dict[str, object]] = {}
        for index, values in state["state"].items():
            name = names[id(order[index])]
            tensors[index] = {key: self._saved(f"{name}.{key}", value) for key, value in values.items()}
        return {"state": tensors, "param_groups": copy.deepcopy(state["param_groups"])}

    def load_optimizer_state(self, state: dict | None) -> None:
        """Restore what `optimizer_state` returned; a swapped stage then parks it in host memory, as
        after its update."""
        if self.optimizer is None or state is None:
            return
        self.optimizer.load_state_dict(state)
        if not self.swapped:
            return
        names = {id(p): n for n, p in self.params.items()}
        for param, values in self.optimizer.state.items():
            for key, tensor in list(values.items()):
                if isinstance(tensor, torch.Tensor) and tensor.dim() > 0:
                    host = tensor.detach().to("cpu", copy=True)
                    self.host[("optimizer", f"{names[id(param)]}.{key}")] = (
                        host.pin_memory() if self.device.type == "cuda" else host)
                    values[key] = torch.empty(0, dtype=tensor.dtype, device=self.device)

    def _saved(self, name: str, value: object) -> object:
        """One entry of the optimizer's state on the CPU (serialised at once: a CPU tensor needs no copy)."""
        if not isinstance(value, torch.Tensor):
            return value
        if value.numel() == 0 and ("optimizer", name) in self.host:
            value = self.host[("optimizer", name)]
        return value.detach().to("cpu")
