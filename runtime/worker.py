"""One stage on one device: its module, its optimizer, and what it stashes between F and B.

Everything the stage holds is registered in its device's memory pool: weights at start,
gradients from the first backward to the update, optimizer state from the first update,
per microbatch the activations autograd saves (counted with saved_tensors_hooks) until that
microbatch's backward, and the transfer buffers its inputs arrived in.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.fx as fx
from stagewise.compiler.ir import Stage
from stagewise.runtime.pool import MemoryPool, nbytes


class StageWorker:
    def __init__(
        self,
        stage: Stage,
        module: fx.GraphModule,
        pool: MemoryPool,
        optimizer_factory: Callable,
        owned: set[str],
        grad_inputs: set[str],
        is_last: bool,
        shared_names: dict[str, str],
    ):
        self.stage = stage
        self.pool = pool
        self.device = pool.device
        self.module = module.to(self.device)
        self.owned = owned  # parameter names whose gradient counts in global reductions
        self.grad_inputs = grad_inputs  # received values whose gradient goes back to their sender
        self.is_last = is_last
        self.shared_names = shared_names  # canonical FQN of a shared tensor -> this stage's name for it
        # Sorted by name so a saved optimizer state (indexed by position) fits the reloaded stage.
        params = [p for _, p in sorted(self.module.named_parameters())]
        self.optimizer = optimizer_factory(params) if params else None
        self.resident = {p.untyped_storage().data_ptr() for p in self.module.parameters()}
        self.resident |= {b.untyped_storage().data_ptr() for b in self.module.buffers()}
        pool.allocate("weights", ("weights", stage.index), nbytes(list(self.module.parameters()) + list(self.module.buffers())),
                      f"load stage {stage.index}")
        self.inputs: dict[int, dict[str, torch.Tensor]] = {}
        self.buffers: dict[int, list[tuple[torch.Tensor, tuple]]] = {}
        self.outputs: dict[int, tuple] = {}
        self.output_grads: dict[int, dict[str, torch.Tensor]] = {}
        self.input_grads: dict[int, dict[str, torch.Tensor]] = {}
        self.losses: dict[int, torch.Tensor] = {}

    def provide(self, microbatch: int, name: str, value, buffer_key: tuple | None = None) -> None:
        """An input of the stage for one microbatch: a graph input or a received activation."""
        if isinstance(value, torch.Tensor):
            if buffer_key is not None:
                self.buffers.setdefault(microbatch, []).append((value, buffer_key))
            value = value.to(self.device)
            if name in self.grad_inputs:
                value = value.detach().requires_grad_(True)
        self.inputs.setdefault(microbatch, {})[name] = value

    def forward(self, microbatch: int, instruction: str, stash: bool = True) -> None:
        """Run the stage on one microbatch. Without `stash` autograd records nothing and only the
        inputs stay (a recompute, the same call with stash=True, rebuilds the graph before B)."""
        args = [self.inputs[microbatch][name] for name in self.stage.inputs]
        saved: list[torch.Tensor] = []
        with torch.set_grad_enabled(stash), torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            outputs = self.module(*args)
        self.outputs[microbatch] = outputs
        stashed = [t for t in saved + list(outputs) if isinstance(t, torch.Tensor)
                   and t.untyped_storage().data_ptr() not in self.resident]
        self.pool.allocate("stash", ("stash", self.stage.index, microbatch), nbytes(stashed), instruction)
        if self.is_last:
            self.losses[microbatch] = outputs[0]
        if stash and not any(isinstance(o, torch.Tensor) and o.requires_grad for o in outputs):
            self._release_inputs(microbatch)

    def output(self, microbatch: int, name: str) -> torch.Tensor:
        return self.outputs[microbatch][self.stage.outputs.index(name)]

    def add_output_grad(self, microbatch: int, name: str, grad: torch.Tensor, buffer_key: tuple) -> None:
        self.buffers.setdefault(microbatch, []).append((grad, buffer_key))
        grads = self.output_grads.setdefault(microbatch, {})
        grads[name] = grad if name not in grads else grads[name] + grad

    def backward(self, microbatch: int, loss_scale: float, instruction: str) -> None:
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
        self.pool.allocate("grads", ("grads", self.stage.index),
                           nbytes(p.grad for p in self.module.parameters() if p.grad is not None), instruction)
        inputs = self.inputs.get(microbatch, {})
        self.input_grads[microbatch] = {
            name: inputs[name].grad.clone() if inputs[name].grad is not None else torch.zeros_like(inputs[name])
            for name in self.grad_inputs
            if name in inputs
        }
        self.pool.release(("stash", self.stage.index, microbatch))
        self._release_inputs(microbatch)

    def _release_inputs(self, microbatch: int) -> None:
        self.inputs.pop(microbatch, None)
        for buffer, key in self.buffers.pop(microbatch, []):
            self.pool.give_back_buffer(buffer, key)

    def take_input_grad(self, microbatch: int, name: str) -> torch.Tensor:
        """The gradient of a received value, handed over once to the send that returns it."""
        grads = self.input_grads[microbatch]
        grad = grads.pop(name)
        if not grads:
            del self.input_grads[microbatch]
        return grad

    def named_grads(self, names) -> list[torch.Tensor]:
        params = dict(self.module.named_parameters(remove_duplicate=False))
        return [params[n].grad if params[n].grad is not None else torch.zeros_like(params[n]) for n in names]

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

    def scale_grads(self, factor: float) -> None:
        for param in self.module.parameters():
            if param.grad is not None:
                param.grad.mul_(factor)

    def update(self, instruction: str) -> None:
        if self.optimizer is None:
            return
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.pool.release(("grads", self.stage.index))
        state = [t for s in self.optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
        self.pool.allocate("optimizer", ("optimizer", self.stage.index), nbytes(state), instruction)
