"""Optimizer parameter groups chosen by the original model's parameter names.

Each stage makes its own optimizer over its own parameters, so a factory `params -> Optimizer`
cannot tell a bias from a weight. `ParamGroups` names the optimizer class, its defaults and a
function of the named parameters that returns torch's parameter groups (as Hugging Face Trainer
builds its no-decay groups). Every stage calls the function with its own parameters under the
model's names, so every stage's optimizer has the same groups in the same order with the same
hyper-parameters (a group a stage has no parameters of stays, empty): a scheduler's per-group
learning rate means the same group everywhere (compiler/pipeline/optimizer_view.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from stagewise.ir.errors import OptionError

NamedParameters = list[tuple[str, torch.nn.Parameter]]
_FIX = ("return a list of dicts, each with 'params' (parameters or their names) and any hyper-parameters, "
        "every trainable parameter in exactly one group")


@dataclass(frozen=True)
class ParamGroups:
    """`optimizer=ParamGroups(torch.optim.AdamW, no_decay_groups, lr=1e-3)`: the stages' optimizers
    are `optimizer_class(groups(named_parameters), **defaults)`; `groups` gets (name, parameter)
    pairs under the original model's names and returns torch parameter groups whose 'params' list
    parameters or names. (A checkpoint records the groups by name, not the function.) Each stage
    calls `groups` with its own parameters, so every stage's optimizer has the same groups.

    Args:
        optimizer_class: a `torch.optim.Optimizer` class, e.g. `torch.optim.AdamW`.
        groups: (name, parameter) pairs -> a list of dicts, each with 'params' (parameters or their
            names) and any hyper-parameters; every trainable parameter in exactly one group.
        **defaults: the optimizer's keyword arguments (lr, weight_decay, ...).

    Raises:
        OptionError: `optimizer_class` is no optimizer class, or `groups` is not callable.

    Example:
        >>> def no_decay_for_biases(named):
        ...     return [{"params": [n for n, _ in named if not n.endswith("bias")]},
        ...             {"params": [n for n, _ in named if n.endswith("bias")], "weight_decay": 0.0}]
        >>> groups = sw.ParamGroups(torch.optim.AdamW, no_decay_for_biases, lr=1e-3, weight_decay=0.1)
        >>> optimizer = groups.build(list(model.named_parameters()))  # what each stage does with its own
        >>> [(len(group["params"]), group["weight_decay"]) for group in optimizer.param_groups]
        [(6, 0.1), (6, 0.0)]
    """

    optimizer_class: type[torch.optim.Optimizer]
    groups: Callable[[NamedParameters], Sequence[dict]]
    defaults: dict

    def __init__(self, optimizer_class: type[torch.optim.Optimizer],
                 groups: Callable[[NamedParameters], Sequence[dict]], **defaults) -> None:
        if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)):
            raise OptionError(f"ParamGroups({optimizer_class!r}, ...): the first argument must be a "
                              "torch.optim.Optimizer class, e.g. torch.optim.AdamW")
        if not callable(groups):
            raise OptionError(f"ParamGroups: groups={groups!r} is not callable; {_FIX}")
        object.__setattr__(self, "optimizer_class", optimizer_class)
        object.__setattr__(self, "groups", groups)
        object.__setattr__(self, "defaults", defaults)

    def __call__(self, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        """One optimizer over unnamed parameters (their names unknown, all in one group): what the
        planner's calibration measures."""
        return self.optimizer_class(params, **self.defaults)

    def build(self, named: NamedParameters) -> torch.optim.Optimizer:
        """The optimizer one stage trains with.

        Args:
            named: the stage's trainable (name, parameter) pairs, under the model's names.

        Returns:
            `optimizer_class` over the parameters grouped by `groups`, with `defaults`.

        Raises:
            OptionError: as `resolve`.

        Example:
            >>> groups = sw.ParamGroups(torch.optim.SGD, lambda named: [{"params": [n for n, _ in named]}], lr=0.1)
            >>> type(groups.build(list(nn.Linear(2, 2).named_parameters()))).__name__
            'SGD'
        """
        return self.optimizer_class(self.resolve(named), **self.defaults)

    def resolve(self, named: NamedParameters) -> list[dict]:
        """The parameter groups `groups` makes of some parameters, checked.

        Args:
            named: trainable (name, parameter) pairs, under the model's names.

        Returns:
            `groups(named)` with each group's 'params' as parameters.

        Raises:
            OptionError: `groups` returned no list of dicts with 'params', a group names something
                that is not one of the parameters, or a parameter is in no group or in two.

        Example:
            >>> groups = sw.ParamGroups(torch.optim.SGD, lambda named: [{"params": ["weight"], "lr": 0.5}], lr=0.1)
            >>> groups.resolve(list(nn.Linear(2, 2).named_parameters()))
            Traceback (most recent call last):
            ...
            stagewise.ir.errors.OptionError: optimizer=ParamGroups: ['bias'] are in no group, ...
        """
        made = self.groups(list(named))
        if not isinstance(made, Sequence) or not all(isinstance(g, dict) and "params" in g for g in made):
            raise OptionError(f"optimizer=ParamGroups: {self.groups!r} returned {made!r}; {_FIX}")
        by_name = dict(named)
        by_id = {id(p): n for n, p in named}
        placed: dict[str, int] = {}
        resolved = []
        for index, group in enumerate(made):
            params = []
            for item in group["params"]:
                name = item if isinstance(item, str) else by_id.get(id(item))
                if name not in by_name:
                    raise OptionError(f"optimizer=ParamGroups: group {index} lists {item!r}, not a trainable "
                                      f"parameter of the model; {_FIX}")
                if name in placed:
                    raise OptionError(f"optimizer=ParamGroups: {name!r} is in groups {placed[name]} and {index}; "
                                      f"{_FIX}")
                placed[name] = index
                params.append(by_name[name])
            resolved.append({**group, "params": params})
        unplaced = [n for n, _ in named if n not in placed]
        if unplaced:
            raise OptionError(f"optimizer=ParamGroups: {unplaced[:5]} are in no group, so eager training would "
                              f"not update them; {_FIX} (freeze a parameter with requires_grad_(False))")
        return resolved


@dataclass(frozen=True)
class StageOptimizerFactory:
    """What a stage's worker calls with its trainable parameters: `spec.build` over them under the
    model's names (`names`: id of each of the stage's parameters -> its name in the model)."""

    spec: ParamGroups
    names: dict[int, str]

    def __call__(self, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        return self.spec.build([(self.names[id(p)], p) for p in params])


def check_param_groups(spec: ParamGroups, model: torch.nn.Module) -> None:
    """At compile: the groups of the whole model resolve (OptionError naming what does not)."""
    spec.resolve([(n, p) for n, p in model.named_parameters() if p.requires_grad])


def sample_optimizer(factory: Callable) -> torch.optim.Optimizer:
    """What `factory` makes of one dummy parameter: its class and defaults, without the model's."""
    return factory([torch.nn.Parameter(torch.zeros(1))])
