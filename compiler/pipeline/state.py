"""A pipeline's training state: the weights under the model's names (`state_dict`,
`load_state_dict`), the optimizer over them, and what a loaded checkpoint brought for the
training loop (the scheduler state, `extra`). `Pipeline` (compiler/pipeline/pipeline.py) builds on
it; it builds on `PipelineReadings` (compiler/pipeline/readings.py). It owns the state it reads.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from stagewise.compiler.assembly.options import check_flags
from stagewise.compiler.assembly.runtime_setup import Runtime
from stagewise.compiler.assembly.state_dict import IncompatibleKeys, aliases_of, check_state_dict
from stagewise.compiler.assembly.tensor_parallel import full_state, local_part
from stagewise.compiler.pipeline.optimizer_view import PipelineOptimizer
from stagewise.compiler.pipeline.readings import Compiled, PipelineReadings
from stagewise.compiler.pipeline.training_state import TrainingState, resume_scheduler
from stagewise.ir.plan import Plan


class PipelineState(PipelineReadings):
    """The state side of a `Pipeline` (see its docstring; `pipe` in the examples is one).

    Args:
        plan: the plan the programs come from.
        runtime: its pools, transport, stage workers and executor in this process.
        compiled: what compiling found beside the plan; None for a loaded pipeline.
        unheld: state_dict entries no stage holds (layers the loss never reaches).
    """

    def __init__(self, plan: Plan, runtime: Runtime, compiled: Compiled | None = None,
                 unheld: dict[str, torch.Tensor] | None = None):
        super().__init__(plan, runtime, compiled)
        # state_dict entries no stage holds (layers the loss never reaches), on the CPU: training
        # leaves them as they are, state_dict returns them and save / load carry them (unused.pt).
        self._unheld = dict(unheld or {})
        self._optimizer: PipelineOptimizer | None = None  # made when first asked for
        self._resumed = TrainingState()  # a loaded pipeline's: the saved scheduler state and `extra`

    @property
    def optimizer(self) -> PipelineOptimizer:
        """The stages' optimizers as one torch.optim.Optimizer over the model (compiler/pipeline/optimizer_view.py):
        a torch.optim.lr_scheduler on it reaches every stage; state_dict() is keyed by the model's names.

        Example:
            >>> isinstance(pipe.optimizer, torch.optim.Optimizer), len(pipe.optimizer.param_groups)
            (True, 1)
        """
        if self._optimizer is None:
            self._optimizer = PipelineOptimizer(self.plan, self._workers, self._executor.settle,
                                                self.context is not None, self._runtime.optimizer_factory)
        return self._optimizer

    @property
    def extra(self) -> dict:
        """The metadata `pipe.save(directory, extra=...)` stored, after `sw.load` ({} otherwise).

        Example:
            >>> _ = pipe.save(tmp / "with_extra", extra={"epoch": 3})
            >>> sw.load(tmp / "with_extra").extra
            {'epoch': 3}
        """
        return self._resumed.extra

    def load_scheduler(self, scheduler) -> None:
        """After `sw.load`: load the scheduler state `pipe.save(directory, scheduler=...)` stored into
        `scheduler` (just made over pipe.optimizer) and put back the learning rates it had, so
        training resumes bitwise (compiler/pipeline/training_state.py).

        Args:
            scheduler: a torch.optim.lr_scheduler made over this pipeline's `optimizer`.

        Example:
            >>> scheduler = torch.optim.lr_scheduler.StepLR(pipe.optimizer, step_size=1, gamma=0.5)
            >>> _ = pipe.save(tmp / "scheduled", scheduler=scheduler)
            >>> loaded = sw.load(tmp / "scheduled")
            >>> resumed = torch.optim.lr_scheduler.StepLR(loaded.optimizer, step_size=1, gamma=0.5)
            >>> loaded.load_scheduler(resumed)
            >>> resumed.state_dict()["last_epoch"] == scheduler.state_dict()["last_epoch"]
            True
        """
        resume_scheduler(self.optimizer, scheduler, self._resumed, self._executor.state.iteration)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The trained state under every key of the original model's state_dict, in its order (tied
        names share one tensor; layers no stage holds as they were at compile). Under
        torch.distributed every rank gathers every stage's state. (A broken pipeline's state may be read.)

        Returns:
            {name: tensor}, as the model's `state_dict()` names them.

        Example:
            >>> state = pipe.state_dict()
            >>> list(state)[:3], list(state) == list(model.state_dict())
            (['0.weight', '0.bias', '2.weight'], True)
        """
        self._executor.settle(broken_ok=True)
        found = self._local_state()
        if self.plan.tensor_parallel is not None:  # every rank its shards: the full tensors gathered
            found = full_state(found, self.plan.tensor_parallel)
        if self.context is not None:
            gathered: list[dict[str, torch.Tensor] | None] = [None] * torch.distributed.get_world_size()
            mine = {k: v.detach().cpu() for k, v in found.items() if k not in self._unheld}  # every rank has those
            torch.distributed.all_gather_object(gathered, mine)
            for part in gathered:
                for name, tensor in (part or {}).items():
                    found.setdefault(name, tensor)
        result = {}
        for name in self.plan.state_names:
            holder = next((n for n in aliases_of(self.plan, name) if n in found), None)
            if holder is not None:
                result[name] = found[holder]
        return result

    def load_state_dict(self, state_dict: Mapping[str, torch.Tensor], strict: bool = True) -> IncompatibleKeys:
        """Copy `state_dict`'s values into the pipeline's state, as torch's `Module.load_state_dict`:
        returns (missing_keys, unexpected_keys); with `strict` either is a StateDictError, and a
        wrongly shaped tensor always is (compiler/assembly/state_dict.py). When it raises nothing is loaded.
        Under torch.distributed every rank calls it with the same state_dict.

        Args:
            state_dict: tensors under the model's names (tied names: any one of them).
            strict: whether a missing or unknown key is an error.

        Returns:
            `IncompatibleKeys(missing_keys, unexpected_keys)`.

        Raises:
            StateDictError: a wrongly shaped tensor, or (strict) a missing or unknown key.
            OptionError: `strict` is not a bool.

        Example:
            >>> pipe.load_state_dict(model.state_dict())
            IncompatibleKeys(missing_keys=[], unexpected_keys=[])
            >>> pipe.load_state_dict({"0.weight": torch.zeros(1)})
            Traceback (most recent call last):
            ...
            stagewise.ir.errors.StateDictError: ...
        """
        check_flags(strict=strict)
        shapes = (dict(zip(self.plan.state_names, self.plan.state_shapes, strict=True)) if self.plan.state_shapes
                  else {n: tuple(t.shape) for n, t in self._local_state().items()})
        result = check_state_dict(self.plan, state_dict, strict, shapes)
        self._executor.settle(broken_ok=True)
        holders = [self._unheld] + [worker.state_tensors() for worker in self._workers]  # every replica of a tie
        with torch.no_grad():
            for held in holders:
                for name, tensor in held.items():
                    source = next((state_dict[a] for a in aliases_of(self.plan, name) if a in state_dict), None)
                    if source is not None and self.plan.tensor_parallel is not None:
                        source = local_part(self.plan.tensor_parallel, name, source)
                    if source is not None:
                        tensor.copy_(source)
        for worker in self._workers:  # 2bw: both versions the loaded weights, as at the start
            worker.weight_versions.match(worker.params)
        return result

    def _local_state(self) -> dict[str, torch.Tensor]:
        """This process's state tensors by name: its stages' and the unheld entries."""
        found = dict(self._unheld)
        for worker in self._workers:
            for name, tensor in worker.state_tensors().items():
                found.setdefault(name, tensor)
        return found
