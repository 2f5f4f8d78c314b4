"""The optimizer as a checkpoint records it: a class by its import path and its defaults, not a pickle.

A pickled factory makes a checkpoint run code when it is read, and one defined in the training
script cannot be unpickled from any other script. What the stages' optimizers are made of is
data: their class by its qualified name (`torch.optim.adamw.AdamW`, or any `torch.optim.Optimizer`
subclass found by its name), its `defaults` (every constructor argument torch optimizers keep),
and which parameters, by name, each group holds with its hyper-parameters (the groups come with
the optimizer state). `sw.load` rebuilds the factory from that (`recorded_optimizer`), taking the
class from torch.optim's optimizers (codegen/allowlist.py) or the caller's `trusted_functions`,
never by importing the module a checkpoint names (its code would run). A class whose defaults do
not rebuild it is recorded as such and loading without the model says so.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping, Sequence

import torch

from stagewise.codegen.allowlist import allowed_optimizer
from stagewise.compiler.assembly.optimizer_groups import NamedParameters, ParamGroups, sample_optimizer
from stagewise.compiler.assembly.plain_values import same_kind
from stagewise.ir.errors import CheckpointError, UntrustedCodeError

_PLAIN = (bool, int, float, str, type(None))


def optimizer_recipe(optimizer: torch.optim.Optimizer | None) -> dict | None:
    """{'class': import path, 'defaults': {...}} of a stage's optimizer, or {'unrecorded': why}."""
    if optimizer is None:
        return None
    cls = type(optimizer)
    path = _class_path(cls)
    defaults = dict(optimizer.defaults)
    if "<" in cls.__qualname__ or not all(_plain(v) for v in defaults.values()):
        return {"unrecorded": f"{path} with defaults {defaults!r} cannot be recorded by name and plain values"}
    accepted = inspect.signature(cls.__init__).parameters  # AdamW keeps Adam's decoupled_weight_decay
    arguments = {k: v for k, v in defaults.items() if k in accepted}
    try:
        rebuilt = sample_optimizer(functools.partial(cls, **arguments))
    except (TypeError, ValueError) as error:
        return {"unrecorded": f"{path}(params, **defaults) does not rebuild it ({error})"}
    if rebuilt.defaults != defaults:
        return {"unrecorded": f"{path}(params, **{arguments!r}) makes other defaults ({rebuilt.defaults!r})"}
    return {"class": path, "defaults": arguments}


def _class_path(cls: type) -> str:
    """What the checkpoint names a class by: its module and qualified name."""
    return f"{cls.__module__}.{cls.__qualname__}"


def _plain(value: object) -> bool:
    if isinstance(value, (tuple, list)):
        return all(_plain(v) for v in value)
    return isinstance(value, _PLAIN)


def recorded_class(path: object, trusted: Mapping[str, Callable]) -> type[torch.optim.Optimizer]:
    """The class training.pt names: torch.optim's of that exact name, or the caller's trusted one."""
    found = (trusted.get(path) or allowed_optimizer(path)) if isinstance(path, str) else None
    if not (isinstance(found, type) and issubclass(found, torch.optim.Optimizer)):
        short = path.rpartition(".")[2] if isinstance(path, str) else "YourOptimizer"
        raise UntrustedCodeError(
            f"training.pt (key 'optimizer') names the optimizer class {path!r}, which is not among torch.optim's "
            "optimizers; a checkpoint never imports the module it names (its code would run). If it is an "
            f"optimizer class you trust, pass it to the load: sw.load(directory, trusted_functions=[{short}])")
    return found


class _SavedGroups:
    """The saved groups as a `ParamGroups` function: each group takes the parameters it held by name
    (a tied parameter under any of its names: the stages may know it by another one)."""

    def __init__(self, groups: Sequence[dict], aliases: Sequence[Sequence[str]]):
        self.groups = [(list(g["param_names"]), {k: v for k, v in g.items() if k != "param_names"}) for g in groups]
        self.group_of = {name: index for index, (names, _) in enumerate(self.groups) for name in names}
        for tie in aliases:
            placed = next((self.group_of[name] for name in tie if name in self.group_of), None)
            if placed is None:
                continue
            for name in tie:
                self.group_of.setdefault(name, placed)

    def __call__(self, named: NamedParameters) -> list[dict]:
        made: list[dict] = [{"params": [], **hyper} for _, hyper in self.groups]
        for name, _ in named:
            if name not in self.group_of:
                raise CheckpointError(f"the checkpoint's optimizer groups do not hold the parameter {name}: it was "
                                      "saved from another model; load it into the model it was saved from")
            made[self.group_of[name]]["params"].append(name)
        return made


def recorded_optimizer(recipe: dict | None, groups: Sequence[dict], aliases: Sequence[Sequence[str]] = (),
                       trusted: Mapping[str, Callable] | None = None) -> ParamGroups:
    """The factory the stages of a loaded pipeline make their optimizers with: the recorded class
    (torch.optim's, or one of `trusted`, {"module.qualname": class}) and defaults, grouped by the
    saved names (`aliases`: the plan's tied names) with each group's saved hyper-parameters."""
    if recipe is None:
        raise CheckpointError("the checkpoint holds no optimizer (no stage had a trainable parameter)")
    if "unrecorded" in recipe:
        raise CheckpointError(f"the checkpoint's optimizer could not be recorded: {recipe['unrecorded']}; load it "
                              "into the model instead: compile the model again with its optimizer, then "
                              "pipe.restore(directory)")
    optimizer = recorded_class(recipe.get("class"), trusted or {})
    if not isinstance(recipe.get("defaults"), dict):
        raise CheckpointError(f"training.pt (key 'optimizer') holds {str(recipe)[:120]!r}, not a class and defaults")
    _check_hyperparameters(optimizer, [recipe["defaults"], *groups])
    return ParamGroups(optimizer, _SavedGroups(groups, aliases), **recipe["defaults"])


def _check_hyperparameters(optimizer: type[torch.optim.Optimizer], tables: Sequence[dict]) -> None:
    """Each saved hyper-parameter the class's constructor takes is of the kind of its default (training.pt
    is untrusted: an `lr` of "0.1" would fail the next step midway, compiler/assembly/plain_values.py)."""
    defaults = {name: p.default for name, p in inspect.signature(optimizer).parameters.items()
                if p.default is not inspect.Parameter.empty}
    for table in tables:
        for key, value in table.items():
            if key in defaults and not same_kind(value, defaults[key]):
                raise CheckpointError(f"training.pt's optimizer gives {key}={repr(value)[:60]}, where "
                                      f"{optimizer.__name__} takes a value like {defaults[key]!r}: the checkpoint "
                                      "was altered; save the pipeline again")


def check_same_optimizer(recipe: dict | None, factory) -> None:
    """CheckpointError where the checkpoint's optimizer state is another class's than the one this
    pipeline's stages step (SGD would silently ignore Adam's moments and start without momentum)."""
    if recipe is None or "class" not in recipe:
        return
    path = _class_path(type(sample_optimizer(factory)))
    if path != recipe["class"]:
        raise CheckpointError(f"the checkpoint holds {recipe['class']}'s optimizer state but this pipeline steps "
                              f"{path}: compile with the optimizer it was saved with, or take the weights alone "
                              "with pipe.restore(directory, training_state=False)")
