"""`pipe.optimizer`: the stages' optimizers seen as one `torch.optim.Optimizer` over the model.

Each stage steps its own optimizer over its own parameters (runtime/worker.py); schedulers and
checkpoints want one optimizer with the model's parameter names. The view has a parameter group
per group of the stages' optimizers (they have the same groups: compiler/assembly/optimizer_groups.py),
holding the stages' parameters under the model's names ('param_names', as torch's named
optimizers). Hyper-parameters set on the view's groups (what every `torch.optim.lr_scheduler`
does to 'lr') reach every stage's group of the same index before the pipeline's next update
(`push_hyperparameters`, called by `Pipeline.step`). `state_dict` gathers the stages' states
keyed by the model's names; `load_state_dict` hands each stage its part. Under torch.distributed
a rank holds only its stages: its view's groups hold those, and steer their hyper-parameters;
`state_dict` and `load_state_dict` are collectives every rank calls (as `pipe.state_dict`): the
ranks gather the parameters' names of every group, and for `state_dict` their states, so every
rank returns, and takes, the whole model's optimizer state as one process would.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator, Mapping

import torch
import torch.distributed as dist

from stagewise.compiler.assembly.optimizer_groups import ParamGroups, sample_optimizer
from stagewise.compiler.assembly.state_dict import model_name
from stagewise.compiler.assembly.tensor_parallel import full_optimizer_state, local_optimizer_state
from stagewise.ir.errors import OptionError, StateDictError
from stagewise.ir.plan import Plan
from stagewise.runtime.worker import StageWorker

_OWN_KEYS = ("params", "param_names")  # a group's keys that are not hyper-parameters


class PipelineOptimizer(torch.optim.Optimizer):
    """The pipeline's optimizer over the whole model (built by `Pipeline.optimizer`)."""

    def __init__(self, plan: Plan, workers: list[StageWorker], settle: Callable[..., None], distributed: bool,
                 factory: Callable | None = None):
        """`settle`: the executor's, which finishes rolling back a stuck step before state is read;
        `factory`: what the stages' optimizers are made with, for a rank that holds none of them."""
        self._stages = [w for w in workers if w.optimizer is not None]
        self._settle = settle
        self._distributed = distributed
        self._factory = factory
        self._parallel = plan.tensor_parallel  # sharded parameters' state is gathered whole, cut on load
        self._names = {id(p): model_name(plan, n) for w in self._stages for n, p in w.params.items()}
        self._position = {n: i for i, n in enumerate(plan.state_names)}  # the model's order
        if self._stages:
            groups = self._stage_groups()
        elif distributed and factory is not None:  # a rank whose stages train nothing
            groups = _idle_groups(factory)
        else:
            raise OptionError("this pipeline holds no trainable parameter: there is no optimizer")
        super().__init__(groups, {})
        self.state = _StageStates(self._stages)  # type: ignore[assignment]

    def _stage_groups(self) -> list[dict]:
        """One group per group of the stages' optimizers: their parameters in the model's order."""
        counts = {len(_optimizer(w).param_groups) for w in self._stages}
        if len(counts) != 1:
            raise OptionError(f"the stages' optimizers have {sorted(counts)} parameter groups: the optimizer factory "
                              "must make the same groups on every stage; use optimizer=stagewise.ParamGroups(...) "
                              "to group parameters by name")
        groups, seen = [], set()
        for index in range(counts.pop()):
            params, names = [], []
            for worker in self._stages:
                for param in _optimizer(worker).param_groups[index]["params"]:
                    name = self._names[id(param)]
                    if name not in seen:  # a tied parameter: its first holder stands for it
                        seen.add(name)
                        params.append(param)
                        names.append(name)
            order = sorted(range(len(names)), key=lambda i: self._ordered(names[i]))
            params, names = [params[i] for i in order], [names[i] for i in order]
            hyper = {k: v for k, v in _optimizer(self._stages[0]).param_groups[index].items() if k not in _OWN_KEYS}
            groups.append({"params": params, "param_names": names, **hyper})
        return groups

    def rebind(self, plan: Plan, workers: list[StageWorker], settle: Callable[..., None]) -> None:
        """Stand for the stages of another runtime of the same plan (`pipe.resize`), staying the object
        a scheduler holds; the groups' hyper-parameters come from those stages' optimizers."""
        self.__init__(plan, workers, settle, self._distributed, self._factory)  # type: ignore[misc]

    def push_hyperparameters(self) -> None:
        """Copy every group's hyper-parameters (lr, weight_decay, initial_lr, ...) to the group of
        the same index of every stage's optimizer."""
        for index, group in enumerate(self.param_groups):
            hyper = {k: v for k, v in group.items() if k not in _OWN_KEYS}
            for worker in self._stages:
                _optimizer(worker).param_groups[index].update(hyper)

    def pull_hyperparameters(self) -> None:
        """Set every group's hyper-parameters from the stages' optimizers (where a loaded
        checkpoint put them)."""
        if not self._stages:
            return  # a rank without trainable parameters: its scheduler sets the groups as every rank's does
        for index, group in enumerate(self.param_groups):
            stage_group = _optimizer(self._stages[0]).param_groups[index]
            group.update({k: v for k, v in stage_group.items() if k not in _OWN_KEYS})

    def note_step(self) -> None:
        """A pipeline step updated the weights: a scheduler stepped after it is in order (torch's
        LRScheduler warns unless the optimizer's step ran, which `_opt_called` records)."""
        self._opt_called = True

    def step(self, closure=None):  # noqa: ANN001 - torch's signature
        raise OptionError("pipe.optimizer.step() is not how a pipeline updates: pipe.step(inputs, target=...) runs "
                          "the forward, backward and every stage's optimizer step")

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing to do: every stage's update clears its gradients itself."""

    def state_dict(self) -> dict:
        """{'state': {model name: {key: value}}, 'param_groups': [{hyper-parameters..., 'param_names'}]},
        on the CPU; under torch.distributed every rank calls it and gets the whole model's."""
        self._settle(broken_ok=True)
        state: dict[str, dict] = {}
        for worker in self._stages:
            saved = worker.optimizer_state() or {"state": {}}
            order = [p for group in _optimizer(worker).param_groups for p in group["params"]]
            for index, values in saved["state"].items():
                state.setdefault(self._names[id(order[index])], values)
        names = [list(g["param_names"]) for g in self.param_groups]
        if self._parallel is not None:  # the moments of this rank's sharded parameters, whole (from its stage group)
            state = full_optimizer_state(state, self._parallel)
        if self._distributed:
            parts: list = [None] * dist.get_world_size()
            dist.all_gather_object(parts, (state, names))
            state = {}
            for part_state, _ in parts:  # a tied parameter: its first holder stands for it, as in one process
                for name, values in part_state.items():
                    state.setdefault(name, values)
            names = self._merged([part_names for _, part_names in parts])
        state = {name: state[name] for name in sorted(state, key=self._ordered)}  # the model's order, however made
        groups = [{**{k: copy.deepcopy(v) for k, v in g.items() if k not in _OWN_KEYS}, "param_names": group_names}
                  for g, group_names in zip(self.param_groups, names, strict=True)]
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore what `state_dict` returned (of this model, with the same groups): each stage gets
        its parameters' state and the groups' hyper-parameters. Under torch.distributed every rank
        calls it with the same state_dict."""
        names = [list(g["param_names"]) for g in self.param_groups]
        if self._distributed:
            parts: list = [None] * dist.get_world_size()
            dist.all_gather_object(parts, names)
            names = self._merged(parts)
        groups = _checked_groups(state_dict, names)
        if self._parallel is not None:
            state_dict = {**state_dict, "state": local_optimizer_state(state_dict["state"], self._parallel)}
        self._settle(broken_ok=True)
        for worker in self._stages:
            order = [p for group in _optimizer(worker).param_groups for p in group["params"]]
            indices = {id(p): i for i, p in enumerate(order)}
            stage_state = {indices[id(p)]: state_dict["state"][self._names[id(p)]] for p in order
                           if self._names[id(p)] in state_dict["state"]}
            stage_groups = [{**{k: v for k, v in saved.items() if k not in _OWN_KEYS},
                             "params": [indices[id(p)] for p in group["params"]]}
                            for saved, group in zip(groups, _optimizer(worker).param_groups, strict=True)]
            worker.load_optimizer_state(copy.deepcopy({"state": stage_state, "param_groups": stage_groups}))
        for saved, group in zip(groups, self.param_groups, strict=True):
            group.update({k: copy.deepcopy(v) for k, v in saved.items() if k not in _OWN_KEYS})

    def _ordered(self, name: str) -> int:
        return self._position.get(name, len(self._position))

    def _merged(self, parts: list[list[list[str]]]) -> list[list[str]]:
        """Every rank's names of each group as one list per group, in the model's order."""
        return [sorted({n for part in parts for n in part[index]}, key=self._ordered)
                for index in range(len(self.param_groups))]


class _StageStates(Mapping):
    """The view's `state`: each parameter's state in its stage's optimizer, read-only. A swapped
    stage's state lives in host memory between steps (its device tensors are then empty):
    `state_dict()` reads it from wherever it is."""

    def __init__(self, stages: list[StageWorker]):
        self._stages = stages

    def __getitem__(self, param: torch.Tensor) -> dict:
        for worker in self._stages:
            state = _optimizer(worker).state
            if param in state:
                return state[param]
        raise KeyError(param)

    def __iter__(self) -> Iterator[torch.Tensor]:
        seen: set[int] = set()
        for worker in self._stages:
            for param in _optimizer(worker).state:
                if id(param) not in seen:
                    seen.add(id(param))
                    yield param

    def __len__(self) -> int:
        return sum(1 for _ in self)


def _optimizer(worker: StageWorker) -> torch.optim.Optimizer:
    assert worker.optimizer is not None  # the view keeps only stages with an optimizer
    return worker.optimizer


def _idle_groups(factory: Callable) -> list[dict]:
    """For a rank that holds no trainable parameter (under torch.distributed), the groups every
    stage's optimizer has, empty, with their hyper-parameters: a scheduler every rank makes over
    `pipe.optimizer` then steps alike everywhere."""
    defaults = sample_optimizer(factory).defaults
    made = factory.groups([]) if isinstance(factory, ParamGroups) else [{}]
    return [{**defaults, **{k: v for k, v in g.items() if k != "params"}, "params": [], "param_names": []}
            for g in made]


def _checked_groups(state_dict: object, want: list[list[str]]) -> list[dict]:
    """The saved groups, if `state_dict` is one of this model's optimizer (StateDictError if not)."""
    if not isinstance(state_dict, Mapping) or set(state_dict) != {"state", "param_groups"}:
        raise StateDictError("pipe.optimizer.load_state_dict takes what pipe.optimizer.state_dict() returned: a dict "
                             "with 'state' (by parameter name) and 'param_groups'")
    saved = state_dict["param_groups"]
    got = [list(g.get("param_names", [])) for g in saved]
    if got != want:
        raise StateDictError(f"the optimizer state_dict's groups name parameters {got[:2]}... but this pipeline's are "
                             f"{want[:2]}...: load the state of the same model with the same optimizer groups")
    unknown = set(state_dict["state"]) - {n for names in want for n in names}
    if unknown:
        raise StateDictError(f"the optimizer state_dict has state for {sorted(unknown)[:5]}, not parameters of this "
                             "pipeline's optimizer groups")
    return list(saved)
