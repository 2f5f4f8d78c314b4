"""The sizes of what a step's microbatches send between stages, known before the step runs.

A pipeline trains on batches of any shape the stage code takes (a shorter sequence, a smaller
image, an uneven last microbatch). The plan's transfers hold the example's shapes; for a
microbatch of other sizes every value sent gets its shape and dtype before the step (under
torch.distributed a receiver allocates its buffer from it before the message arrives), and input
sizes the stage code cannot take are refused before anything runs, naming the stage and the op,
instead of failing in the middle of a step. The shapes come from the microbatch's size class
(compiler/assembly/size_classes.py: the stage modules run once on symbolic sizes, evaluated per
shape in microseconds) where its guards hold, else from the stage modules run on fake tensors of
these sizes, in pipeline order. Stages run under the plan's precision (a bf16 activation is sent
as bf16). Each signature's shapes are cached.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode

from stagewise.compiler.assembly.size_classes import ClassKey, Signature, SizeClass, ValueSpec, class_key
from stagewise.ir.declared import dtype_named
from stagewise.ir.errors import ExampleInputsError
from stagewise.ir.plan import Plan, Stage
from stagewise.ir.precision import autocast_for
from stagewise.ir.random_streams import drawing
from stagewise.passes.profile_shapes import quiet_fake_tensor_log

StateSpecs = dict[str, tuple[tuple[int, ...], tuple[int, ...], torch.dtype]]  # tensor name -> size, stride, dtype
TransferSpecs = dict[tuple[str, int], ValueSpec]  # (value, microbatch) -> its sizes and dtype this step


class StepShapes:
    """Per step, the shape and dtype of every transferred value of every microbatch (None when every
    microbatch is shaped like the example and the plan is fp32: the plan's shapes and dtypes hold)."""

    def __init__(self, plan: Plan, modules: Sequence[fx.GraphModule | None], states: Sequence[StateSpecs | None],
                 devices: Sequence[torch.device]):
        self.plan = plan
        self.modules = modules  # every stage's module (another rank's may hold meta tensors); None: not known here
        self.states = states  # every stage's parameters and buffers, read before swapping emptied any
        self.devices = devices  # per plan device: where its fake tensors live
        self.example = _example_signature(plan)
        self.user_names = dict(zip(plan.graph_inputs, plan.input_names + (plan.target_name or "target",), strict=False))
        self.cache: dict[Signature, dict[str, ValueSpec]] = {}
        self.classes: dict[ClassKey, SizeClass | None] = {}  # None: the class cannot be propagated symbolically

    def of_step(self, pieces: Sequence[dict[str, torch.Tensor | None]], alike: bool = False) -> TransferSpecs | None:
        """The transfers' sizes for these microbatches (graph input name -> tensor), or None where every
        microbatch is shaped like the example. Raises ExampleInputsError for sizes the code cannot take.
        `alike`: every microbatch has the first's sizes and dtypes (an even split, `splits_evenly`), so
        one is read for all (every step pays this)."""
        if alike and pieces:
            signatures = [_signature(pieces[0])] * len(pieces)
        else:
            signatures = [_signature(piece) for piece in pieces]
        if self.plan.precision == "fp32" and all(signature == self.example for signature in signatures):
            return None  # the plan's shapes and dtypes (traced in fp32; under autocast some are bf16 / fp16)
        sent = {t.value for t in self.plan.transfers}
        specs: TransferSpecs = {}
        for microbatch, signature in enumerate(signatures):
            values = self.cache.get(signature)
            if values is None:
                values = self.cache[signature] = self._values(signature)
            specs.update({(name, microbatch): values[name] for name in sent if name in values})
        return specs

    def _values(self, signature: Signature) -> dict[str, ValueSpec]:
        """Every value's sizes and dtype at this signature: from its size class where the class's
        guards hold, else from a concrete propagation (which refuses sizes the code cannot take)."""
        size_class = self.size_class(signature)
        values = size_class.at(signature) if size_class is not None else None
        if values is None:
            mode = FakeTensorMode()
            with mode:
                env = {name: torch.empty(size, dtype=dtype) for name, size, dtype in signature}
            values = _specs(self._propagate(mode, env, signature))
        return values

    def size_class(self, signature: Signature) -> SizeClass | None:
        """The symbolic propagation of this signature's class (made once), at the example's sizes where
        it has them; None where it cannot be made (the class's signatures then propagate concretely)."""
        key = class_key(signature)
        if key not in self.classes:
            hints = self.example if class_key(self.example) == key else signature
            try:
                self.classes[key] = SizeClass.traced(hints, lambda mode, env: self._propagate(mode, env, hints))
            except Exception:  # noqa: BLE001 - an op without symbolic sizes: concrete propagation still works
                self.classes[key] = None
        return self.classes[key]

    def _described(self, signature: Signature) -> str:
        """The microbatch's sizes under the model's input names."""
        return ", ".join(f"{self.user_names.get(name, name)} {list(size)}" for name, size, _ in signature)

    def _propagate(self, mode: FakeTensorMode, env: dict[str, torch.Tensor], signature: Signature
                   ) -> dict[str, torch.Tensor]:
        """Every stage output for one microbatch whose inputs are `env` (fake tensors of `mode`)."""
        with mode, drawing(self.plan.seed, 0, 0, training=False), torch.no_grad():
            for stage in _one_instance_per_position(self.plan.stages):
                module, state = self.modules[stage.index], self.states[stage.index]
                if module is None or state is None:
                    raise ExampleInputsError(f"the shapes of a step of other sizes cannot be derived without stage "
                                             f"{stage.index}'s code; give batches shaped like the example")
                device = self.devices[stage.device]
                args = tuple(_moved(env[name], device) if isinstance(env.get(name), torch.Tensor) else env.get(name)
                             for name in stage.inputs)
                try:
                    with quiet_fake_tensor_log(), autocast_for(self.plan.precision, device):
                        outputs = torch.func.functional_call(module, _fake_state(state, device), args)
                except Exception as error:  # noqa: BLE001 - any op refusing the sizes is the user's input
                    raise ExampleInputsError(
                        f"step got inputs of sizes {self._described(signature)} that stage {stage.index}'s code cannot "
                        f"take ({type(error).__name__}: {_first_line(error)}); give sizes like the example's "
                        f"{self._described(self.example)}") from error
                env.update(zip(stage.outputs, outputs, strict=True))
        return env


def _specs(env: dict[str, torch.Tensor]) -> dict[str, ValueSpec]:
    return {name: (tuple(value.shape), value.dtype) for name, value in env.items() if isinstance(value, torch.Tensor)}


def _one_instance_per_position(stages: Sequence[Stage]) -> list[Stage]:
    """One stage instance per pipeline position (replicas run the same code), in dataflow order."""
    first: dict[int, Stage] = {}
    for stage in stages:
        first.setdefault(stage.position, stage)
    return sorted(first.values(), key=lambda s: min(s.layers, default=0))


def state_specs(module: torch.nn.Module) -> StateSpecs:
    """The sizes of the module's parameters and buffers (every name, ties included), read while they
    are whole: a swapped stage's parameters are empty on the device between uses."""
    named = chain(module.named_parameters(remove_duplicate=False), module.named_buffers(remove_duplicate=False))
    return {name: (tuple(t.shape), tuple(t.stride()), t.dtype) for name, t in named}


def _fake_state(state: StateSpecs, device: torch.device) -> dict[str, torch.Tensor]:
    """Fake stand-ins of a stage's parameters and buffers on `device`."""
    return {name: torch.empty_strided(size, stride, dtype=dtype, device=device)
            for name, (size, stride, dtype) in state.items()}


def _moved(value: torch.Tensor, device: torch.device) -> torch.Tensor:
    return value if value.device == device else torch.empty_like(value, device=device)


def _signature(piece: dict[str, torch.Tensor | None]) -> Signature:
    """Per tensor (name, sizes, dtype); the sizes as the tensor's own `torch.Size` (a tuple: equal and
    hashed as one), not copied, since every microbatch of every step is read here."""
    return tuple([(name, v.shape, v.dtype) for name, v in piece.items() if isinstance(v, torch.Tensor)])


def _example_signature(plan: Plan) -> Signature:
    """A microbatch of the example's sizes, as `_signature` reads it."""
    result = []
    for name, spec in zip(plan.graph_inputs, plan.input_specs, strict=False):
        dtype = dtype_named(spec.dtype, f"the plan's input {name!r}")
        size = (plan.microbatch_size, *spec.shape) if spec.batched else spec.shape
        result.append((name, tuple(size), dtype))
    return tuple(result)


def _first_line(error: Exception) -> str:
    lines = str(error).strip().splitlines()
    return lines[0][:300] if lines else ""
