"""One stage on one device: its module, its optimizer, and what it stashes between F and B.

Everything the stage holds is registered in its device's memory pool: weights at start,
gradients from the first backward to the update, optimizer state from the first update,
per microbatch the activations autograd saves (held through saved_tensors_hooks) until that
microbatch's backward, and the transfer buffers its inputs arrived in. A program may move a
microbatch's stash to host memory between its forward and its backward (`stash-out`,
`stash-in`: Harmony's sX); the pool then holds it only while it is on the device.

With the optimizer on the host (an update instruction that says "host") the optimizer steps an
fp32 master copy of each parameter in host memory, with the gradients the program copied there,
and keeps its state there: the device pool never holds optimizer state. The optimizer stays the
one built over the stage's parameters (so its state_dict keeps its layout): for the step each
parameter points at its master and host gradient, and back at its device copy after.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.fx as fx

from stagewise.ir.errors import PlanError
from stagewise.ir.plan import Stage
from stagewise.runtime.checkpoint_access import CheckpointAccess
from stagewise.runtime.grad_bytes import GradBytes
from stagewise.runtime.grad_norm import square_sum
from stagewise.runtime.host_step import host_step
from stagewise.runtime.pool import MemoryPool, nbytes
from stagewise.runtime.split_backward import WeightPass, input_grads
from stagewise.runtime.stage_calls import StageCall
from stagewise.runtime.stage_keys import StageKeys
from stagewise.runtime.stash import HostBuffers, Stash, storage_of, unpack
from stagewise.runtime.weight_versions import WeightVersions

_NO_INPUTS: dict[str, torch.Tensor] = {}  # a microbatch given no input (never written)


class StageWorker(CheckpointAccess):
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
        swapped: bool = False,
        swapped_stashes: frozenset[int] = frozenset(),
    ):
        self.stage = stage
        self.keys = StageKeys(stage.index, stage.outputs)
        self.swapped_stashes = swapped_stashes  # microbatches whose stash the program moves to host memory
        self.pool = pool
        self.device = pool.device
        self.swapped = swapped  # parameters live in host memory between uses (Harmony swapping)
        self.host: dict[tuple[str, str], torch.Tensor] = {}
        self.norm_part: torch.Tensor | None = None  # this stage's squared gradient norm, counted ahead
        self.clip_coefficient: float | None = None  # for an update that scales the gradients itself
        self.on_host = False  # the optimizer steps host masters (set by the first host update)
        self.versions: dict[str, int] = {}  # device parameters' versions when their master was current
        self.weight_versions = WeightVersions()  # 2bw's newest weights (runtime/weight_versions.py)
        self.params = dict(module.named_parameters())
        self.grad_bytes = GradBytes(self.params)
        self.aliases = dict(module.named_parameters(remove_duplicate=False))  # every name, ties included
        if swapped:
            self._start_on_host(module)
        self.module = module.to(self.device)
        self.dtypes = {n: p.dtype for n, p in self.params.items()}
        self.owned = owned  # parameter names whose gradient counts in global reductions
        self.sharded: frozenset[str] = frozenset()  # tensor-parallel shards: squares summed over the stage's ranks
        self.grad_inputs = grad_inputs  # received values whose gradient goes back to their sender
        self.is_last = is_last
        self.shared_names = shared_names  # canonical FQN of a shared tensor -> this stage's name for it
        # Sorted by name so a saved optimizer state (by position) fits the reloaded stage; frozen ones left out
        params = [p for _, p in sorted(self.module.named_parameters()) if p.requires_grad]
        self.optimizer = optimizer_factory(params) if params else None
        self._note_resident()
        pool.allocate("buffers", ("buffers", stage.index), nbytes(self.module.buffers()), f"load stage {stage.index}")
        if not swapped:
            pool.allocate("weights", ("weights", stage.index), nbytes(self.module.parameters()), f"load stage {stage.index}")
        self.inputs: dict[int, dict[str, torch.Tensor]] = {}
        self.buffers: dict[int, list[tuple[torch.Tensor, tuple]]] = {}
        self.outputs: dict[int, tuple] = {}
        self.output_grads: dict[int, dict[str, torch.Tensor]] = {}
        self.input_grads: dict[int, dict[str, torch.Tensor]] = {}
        self.losses: dict[int, torch.Tensor] = {}
        self.stashes: dict[int, Stash] = {}  # per microbatch, from its forward to its backward
        self.weight_passes: dict[int, WeightPass] = {}  # per microbatch, from its input gradient to its weight's
        self.recorded_bytes = 0  # the gradients the last input gradient recorded for its weight gradient
        self.stash_size: dict[tuple, int] = {}  # bytes one forward stashes, by (autograd on, its input sizes)
        self.host_bytes = HostBuffers(self.device)  # recycled host memory for stashes
        self.call: StageCall | None = None  # compiled or graphed forwards (runtime/stage_calls.py); None: the module

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
        inputs stay (a recompute, the same call with stash=True, rebuilds the graph before B).

        What autograd saves goes through saved_tensors_hooks into a `Stash`, by handle, so that a
        a `stash-out` can move it to host memory and a `stash-in` bring it back before B;
        that happens for the microbatches the program swaps, and once to measure the stash size.
        The stash counted in the pool is that and the outputs, less the stage's state and the
        microbatch's inputs (received transfer buffers, counted as such, or the caller's tensors)."""
        inputs = self.inputs.get(microbatch, _NO_INPUTS)  # a stage may take no input (rotary embeddings)
        args = [inputs[name] for name in self.stage.inputs]
        key = (stash, tuple([a.shape for a in args if isinstance(a, torch.Tensor)]))  # per input sizes
        size = self.stash_size.get(key)
        if size is not None and microbatch not in self.swapped_stashes:
            # saved_tensors_hooks call Python for every tensor autograd saves (a GPT block's forward
            # took 1.6x as long): a stash that stays on the device is the size the first one measured
            if torch.is_grad_enabled() == stash:  # a stream thread's mode: no context to enter
                outputs = self._run(microbatch, args)
            else:
                with torch.set_grad_enabled(stash):
                    outputs = self._run(microbatch, args)
        else:
            kept = self.resident | {storage_of(t) for t in inputs.values() if isinstance(t, torch.Tensor)}
            saved = self.stashes[microbatch] = Stash(self.device, kept)  # held before a failing forward fills it
            with torch.set_grad_enabled(stash), torch.autograd.graph.saved_tensors_hooks(saved.pack, unpack):
                outputs = self._run(microbatch, args)
            saved.add_outputs(outputs)
            size = self.stash_size[key] = saved.nbytes()
        self.outputs[microbatch] = outputs
        self.pool.allocate("stash", self.keys.stash(microbatch), size, instruction)
        if self.is_last:
            self.losses[microbatch] = outputs[0].detach()  # the graph goes with `outputs`, on this thread
        if stash and not any(isinstance(o, torch.Tensor) and o.requires_grad for o in outputs):
            self._release_inputs(microbatch)

    def _run(self, microbatch: int, args: list) -> tuple:
        return self.module(*args) if self.call is None else self.call(self.module, microbatch, args)

    def output(self, microbatch: int, name: str) -> torch.Tensor:
        return self.outputs[microbatch][self.keys.output_index[name]]

    def add_output_grad(self, microbatch: int, name: str, grad: torch.Tensor, buffer_key: tuple) -> None:
        self.buffers.setdefault(microbatch, []).append((grad, buffer_key))
        grads = self.output_grads.setdefault(microbatch, {})
        grads[name] = grad if name not in grads else grads[name] + grad

    def backward(self, microbatch: int, loss_scale: float, instruction: str) -> None:
        if not self.swapped:
            self.pool.allocate("grads", self.keys.grads, self.grad_bytes.from_start(), instruction)
        stash = self._stash_for(microbatch, instruction, keep=False)
        tensors, grads = self._seeds(microbatch, loss_scale)
        if tensors:
            torch.autograd.backward(tensors, grads)
        self._keep_input_grads(microbatch, lambda name, value: value.grad)
        self._backward_done(microbatch, stash, instruction)

    def backward_input(self, microbatch: int, loss_scale: float, instruction: str) -> None:
        """Zero bubble's B: the gradients of the inputs only, for the sends that follow; the autograd
        graph, the stash and the inputs stay for the microbatch's `backward_weight`, and so do the
        gradients recorded at the weights' layers (counted in the pool as stash until W)."""
        self._stash_for(microbatch, instruction, keep=True)
        tensors, grads = self._seeds(microbatch, loss_scale)
        inputs = self.inputs.get(microbatch, _NO_INPUTS)
        leaves = [name for name in self.grad_inputs if name in inputs and inputs[name].requires_grad]
        found, weight_pass = input_grads(tensors, grads, [inputs[name] for name in leaves], self.params.values())
        self.weight_passes[microbatch] = weight_pass
        self.recorded_bytes = weight_pass.held_bytes()  # held to W beside the stash (the last B's: measured)
        self.pool.allocate("stash", self.keys.weight_grad_inputs(microbatch), self.recorded_bytes, instruction)
        by_name = dict(zip(leaves, found, strict=True))
        self._keep_input_grads(microbatch, lambda name, value: by_name.get(name))

    def backward_weight(self, microbatch: int, instruction: str) -> None:
        """Zero bubble's W: the weights' gradients of the microbatch whose B ran, then what a whole
        backward frees (its stash, inputs and received buffers)."""
        weight_pass = self.weight_passes.pop(microbatch, None)
        if weight_pass is None:
            raise PlanError(f"`{instruction}` runs before the input gradient of stage {self.stage.index} "
                            f"microbatch {microbatch}: the program lacks its `Bi`")
        stash = self._stash_for(microbatch, instruction, keep=False)
        weight_pass.run()
        self.pool.release(self.keys.weight_grad_inputs(microbatch))
        self._backward_done(microbatch, stash, instruction)

    def _stash_for(self, microbatch: int, instruction: str, keep: bool) -> Stash | None:
        """The microbatch's stash (taken off the worker unless `keep`), which must be on the device."""
        stash = self.stashes.get(microbatch) if keep else self.stashes.pop(microbatch, None)
        if stash is not None and stash.on_host:
            raise PlanError(f"`{instruction}` runs while microbatch {microbatch}'s stash of stage {self.stage.index} is "
                            "in host memory: the program lacks its `stash-in`")
        return stash

    def _seeds(self, microbatch: int, loss_scale: float) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The outputs a backward starts from and their gradients (received ones, the loss's seed)."""
        outputs = self.outputs.pop(microbatch)
        tensors, grads = [], []
        output_grads = self.output_grads.pop(microbatch, None)
        if output_grads is not None:
            index = self.keys.output_index
            for name, grad in output_grads.items():
                tensor = outputs[index[name]]
                if tensor.requires_grad:
                    tensors.append(tensor)
                    grads.append(grad)
        if self.is_last and loss_scale and outputs[0].requires_grad:  # a loss of weight 0 (no counted item) is
            tensors.append(outputs[0])                                 # left out: its mean is 0 / 0
            grads.append(torch.full_like(outputs[0], loss_scale))
        return tensors, grads

    def _keep_input_grads(self, microbatch: int, grad_of: Callable[[str, torch.Tensor], torch.Tensor | None]) -> None:
        """Each received value's gradient, for the send that returns it (zeros where none flowed)."""
        if self.grad_inputs:
            inputs = self.inputs.get(microbatch, _NO_INPUTS)
            self.input_grads[microbatch] = {
                name: grad.clone() if (grad := grad_of(name, inputs[name])) is not None else torch.zeros_like(inputs[name])
                for name in self.grad_inputs if name in inputs}

    def _backward_done(self, microbatch: int, stash: Stash | None, instruction: str) -> None:
        if stash is not None:
            stash.release()  # what no backward reached stays saved otherwise (runtime/stash.py)
        self.pool.allocate("grads", self.keys.grads, self.grad_bytes.count(), instruction)
        self.pool.release(self.keys.stash(microbatch))
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
        params = self.aliases
        return [grad if (grad := params[n].grad) is not None else torch.zeros_like(params[n]) for n in names]

    def set_grads(self, names, grads) -> None:
        for name, grad in zip(names, grads, strict=True):
            self.aliases[name].grad = grad

    def grad_square_sum(self) -> torch.Tensor:
        """Sum of squared gradient entries over the parameters this stage counts in the norm, where
        the gradients are: on the device, or in host memory (runtime/grad_norm.py)."""
        return square_sum(self.module, self.owned, self.sharded, self.host, self.device)

    def count_grad_norm(self) -> None:
        """Count this stage's part of the global norm now (its gradients are final, and may leave the
        device before the all-reduce of the parts): the update then applies the clip coefficient."""
        self.norm_part = self.grad_square_sum()

    def scale_grads(self, factor: float) -> None:
        for param in self.module.parameters():
            if param.grad is not None:
                param.grad.mul_(factor)

    # ---- swapping between the device pool and host memory (Harmony §4.4) --------------------
    def _start_on_host(self, module: torch.nn.Module) -> None:
        """Keep parameters in (pinned, on CUDA) host memory; the device gets them on swap-in."""
        for name, param in self.params.items():
            host = param.data.detach().to("cpu")
            self.host[("weights", name)] = host.pin_memory() if self.device.type == "cuda" else host
            param.data = torch.empty(0, dtype=param.dtype, device=self.device)

    def _note_resident(self) -> None:
        self.resident = {t.untyped_storage().data_ptr() for t in list(self.module.parameters()) + list(self.module.buffers())}

    def tensors(self, what: str, microbatch: int | None = None) -> dict[str, torch.Tensor]:
        """The device tensors of `what` (a microbatch's for "stash"), e.g. to hand them to another stream."""
        if what == "stash":
            stash = self.stashes.get(microbatch) if microbatch is not None else None
            return {str(i): t for i, t in enumerate(stash.device_tensors())} if stash is not None else {}
        if what == "weights":
            return {n: p.data for n, p in self.params.items()}
        if what == "grads":
            return {n: p.grad for n, p in self.params.items() if p.grad is not None}
        state = self.optimizer.state if self.optimizer else {}
        names = {id(p): n for n, p in self.params.items()}
        return {f"{names[id(p)]}.{k}": v for p, st in state.items() for k, v in st.items()
                if isinstance(v, torch.Tensor) and v.dim() > 0}

    def _set(self, what: str, name: str, tensor: torch.Tensor) -> None:
        if what == "weights":
            self.params[name].data = tensor
        elif what == "grads":
            self.params[name].grad = tensor
        elif self.optimizer is not None:  # "optimizer": only a stage with one holds its state (`tensors`)
            param_name, key = name.rsplit(".", 1)
            self.optimizer.state[self.params[param_name]][key] = tensor

    def swap_out(self, what: str, write: bool, instruction: str, microbatch: int | None = None) -> None:
        """Take `what` off the device; copy it to host memory first when it changed (`write`)."""
        if what == "stash":
            self._stash_out(microbatch, instruction)
            return
        moved = 0
        for name, tensor in self.tensors(what).items():
            if write:
                host = self.host.get((what, name))
                if host is None or host.shape != tensor.shape:
                    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=self.device.type == "cuda")
                    self.host[(what, name)] = host
                host.copy_(tensor, non_blocking=True)
                moved += tensor.numel() * tensor.element_size()
            if what == "grads":
                self.params[name].grad = None
            else:
                self._set(what, name, torch.empty(0, dtype=tensor.dtype, device=self.device))
        if self.device.type == "cuda":
            torch.cuda.current_stream().synchronize()
        self.pool.count_swap_out(what, moved)
        self.pool.release((what, self.stage.index))

    def swap_in(self, what: str, instruction: str, microbatch: int | None = None) -> None:
        """Bring `what` from host memory into the device pool (before the compute that needs it)."""
        if what == "stash":
            self._stash_in(microbatch, instruction)
            return
        parts = {n: h for (w, n), h in self.host.items() if w == what}
        if what == "grads":
            parts = {n: h for n, h in parts.items() if self.params[n].grad is None}
        size = sum(h.numel() * h.element_size() for h in parts.values())
        self.pool.allocate(what, (what, self.stage.index), size, instruction)
        for name, host in parts.items():
            self._set(what, name, self._device_copy(what, name, host))
        if what == "grads":
            for name in parts:
                del self.host[(what, name)]
        self.pool.count_swap_in(what, size)
        if what == "weights":
            self._note_resident()

    def _stash_out(self, microbatch: int | None, instruction: str) -> None:
        """Harmony's sX: microbatch's stashed activations to host memory, released from the pool."""
        stash = self.stashes.get(microbatch) if microbatch is not None else None
        if stash is None or stash.on_host:
            raise PlanError(f"`{instruction}`: stage {self.stage.index} holds no stash of microbatch {microbatch} on the device")
        moved = stash.to_host(self.host_bytes)  # complete (on CUDA: synchronized) when it returns
        self.pool.allocate("stash", ("stash", self.stage.index, microbatch), stash.nbytes() - moved, instruction)
        self.pool.count_swap_out("stash", moved)

    def _stash_in(self, microbatch: int | None, instruction: str) -> None:
        """The stash back into the pool and onto the device, before the microbatch's backward."""
        stash = self.stashes.get(microbatch) if microbatch is not None else None
        if stash is None or not stash.on_host:
            raise PlanError(f"`{instruction}`: stage {self.stage.index} has no stash of microbatch {microbatch} in host memory")
        self.pool.allocate("stash", ("stash", self.stage.index, microbatch), stash.nbytes(), instruction)
        moved = stash.to_device(self.host_bytes)
        self.pool.count_swap_in("stash", moved)

    def _device_copy(self, what: str, name: str, host: torch.Tensor) -> torch.Tensor:
        """A device copy of a host tensor, of its own even where the device is the CPU; weights in
        their parameter's dtype (a host master is fp32), into the device copy if one is resident."""
        if what != "weights":
            return host.to(self.device, non_blocking=True, copy=True)
        current = self.params[name].data
        if current.shape == host.shape and current.numel() > 0:
            current.copy_(host, non_blocking=True)  # a refresh after a host update: in place
            return current
        return host.to(self.device, self.dtypes[name], non_blocking=True, copy=True)

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """The stage's state under its names, host copies standing in for swapped-out parameters."""
        state = self.module.state_dict()
        canonical = {id(p): n for n, p in self.params.items()}
        for name, param in self.aliases.items():  # a tied parameter under each of its names
            key = ("weights", canonical[id(param)])
            if name in state and state[name].numel() == 0 and key in self.host:
                state[name] = self.host[key]
        return state

    def update(self, instruction: str, on_host: bool = False, clip: bool = False) -> None:
        """The optimizer step: on the device, or `on_host` (gradients already copied to host memory).
        With `clip` the gradients are first scaled by the coefficient of the norm counted ahead."""
        coefficient = self.clip_coefficient if clip else None
        self.clip_coefficient = None
        if clip and coefficient is None:
            raise PlanError(f"`{instruction}` clips, but no grad-norm all-reduce of this stage's part came first")
        if self.optimizer is None:
            return
        if on_host:
            host_step(self, self.optimizer, coefficient)
            return
        if coefficient is not None:
            self.scale_grads(coefficient)
        self.weight_versions.step(self.optimizer, self.params)
        self.optimizer.zero_grad(set_to_none=True)
        self.pool.release(self.keys.grads)
        self.pool.allocate("optimizer", ("optimizer", self.stage.index), nbytes(self.tensors("optimizer").values()), instruction)
