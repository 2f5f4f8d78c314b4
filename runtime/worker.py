"""One stage on one device: its module, its optimizer, and what it stashes between F and B."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.fx as fx
from stagewise.compiler.ir import Stage


class StageWorker:
    def __init__(
        self,
        stage: Stage,
        module: fx.GraphModule,
        device: torch.device,
        optimizer_factory: Callable,
        owned: set[str],
        grad_inputs: set[str],
        is_last: bool,
        shared_names: dict[str, str],
    ):
        self.shared_names = shared_names  # canonical FQN of a shared tensor -> this stage's name for it
        self.stage = stage
        self.grad_inputs = grad_inputs  # received values whose gradient goes back to their sender
        self.is_last = is_last
        self.module = module.to(device)
        self.device = device
        # Sorted by name so a saved optimizer state (indexed by position) fits the reloaded stage.
        params = [p for _, p in sorted(self.module.named_parameters())]
        self.optimizer = optimizer_factory(params) if params else None
        self.owned = owned  # parameter names whose gradient counts in global reductions
        self.inputs: dict[int, dict[str, torch.Tensor]] = {}
        self.outputs: dict[int, tuple] = {}
        self.output_grads: dict[int, dict[str, torch.Tensor]] = {}
        self.input_grads: dict[int, dict[str, torch.Tensor]] = {}
        self.losses: dict[int, torch.Tensor] = {}

    def provide(self, microbatch: int, name: str, value) -> None:
        """An input of the stage for one microbatch: a graph input or a received activation."""
        if isinstance(value, torch.Tensor):
            value = value.to(self.device)
            if name in self.grad_inputs:
                value = value.detach().requires_grad_(True)
        self.inputs.setdefault(microbatch, {})[name] = value

    def forward(self, microbatch: int) -> None:
        args = [self.inputs[microbatch][name] for name in self.stage.inputs]
        outputs = self.module(*args)
        self.outputs[microbatch] = outputs
        if self.is_last:
            self.losses[microbatch] = outputs[0]

    def output(self, microbatch: int, name: str) -> torch.Tensor:
        return self.outputs[microbatch][self.stage.outputs.index(name)]

    def add_output_grad(self, microbatch: int, name: str, grad: torch.Tensor) -> None:
        grads = self.output_grads.setdefault(microbatch, {})
        grads[name] = grad if name not in grads else grads[name] + grad

    def backward(self, microbatch: int, loss_scale: float) -> None:
        tensors, grads = [], []
        outputs = self.outputs.pop(microbatch)
        for name, grad in self.output_grads.pop(microbatch, {}).items():
            tensors.append(outputs[self.stage.outputs.index(name)])
            grads.append(grad)
        if self.is_last:
            loss = outputs[0]
            tensors.append(loss)
            grads.append(torch.full_like(loss, loss_scale))
        pairs = [(t, g) for t, g in zip(tensors, grads, strict=True) if t.requires_grad]
        if pairs:
            torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])
        inputs = self.inputs.pop(microbatch)
        self.input_grads[microbatch] = {
            name: inputs[name].grad if inputs[name].grad is not None else torch.zeros_like(inputs[name])
            for name in self.grad_inputs
            if name in inputs
        }

    def take_input_grad(self, microbatch: int, name: str) -> torch.Tensor:
        """The gradient of a received value, handed over once to the send that returns it."""
        grads = self.input_grads[microbatch]
        grad = grads.pop(name)
        if not grads:
            del self.input_grads[microbatch]
        return grad

    def named_grads(self, names) -> list[torch.Tensor]:
        params = dict(self.module.named_parameters(remove_duplicate=False))
        return [_grad(params[n]) for n in names]

    def set_grads(self, names, grads) -> None:
        params = dict(self.module.named_parameters(remove_duplicate=False))
        for name, grad in zip(names, grads, strict=True):
            params[name].grad = grad

    def grad_square_sum(self) -> torch.Tensor:
        """Sum of squared gradient entries over the parameters this stage counts in the norm."""
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        for name, param in self.module.named_parameters():
            if name in self.owned and param.grad is not None:
                total += param.grad.detach().double().pow(2).sum()
        return total

    def scale_grads(self, factor: torch.Tensor) -> None:
        for param in self.module.parameters():
            if param.grad is not None:
                param.grad.mul_(factor.to(param.grad.dtype))

    def update(self) -> None:
        if self.optimizer is not None:
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)


def _grad(param: torch.nn.Parameter) -> torch.Tensor:
    return param.grad if param.grad is not None else torch.zeros_like(param)
