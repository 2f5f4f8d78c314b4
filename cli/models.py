"""Model specs on the command line, and the example batch to plan for.

A spec is a Hugging Face config file (cli/hf_config.py) or `module:factory`: the module is imported
(from the current folder first, as `python -m` would), and `factory()` is called with no arguments.
It returns the model alone; `(model, example_inputs)`; or a dict of `sw.plan`'s keywords: "model",
"example_inputs", and "loss_fn" with "example_target" for a model that does not return its loss.
Without example inputs the model is taken for a language model: random token ids from its
`config.vocab_size`, `--batch` rows of `--seq-len`, labels = ids (the model shifts them).
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from stagewise.cli.errors import CommandLineError, first_line
from stagewise.cli.hf_config import model_from_config

DEFAULT_BATCH = 8
DEFAULT_SEQ_LEN = 1024  # or the model's positions, where fewer
KEYS = ("model", "example_inputs", "loss_fn", "example_target")
_RETURNS = ("the model (a torch.nn.Module), (model, example_inputs), or a dict of "
            f"{', '.join(map(repr, KEYS))}")


@dataclass(frozen=True)
class Workload:
    """What to plan for: the model, one minibatch, and the loss where the model does not return it."""

    model: torch.nn.Module
    example_inputs: Any
    loss_fn: Callable | None = None
    example_target: Any = None

    @property
    def name(self) -> str:
        return type(self.model).__name__


def load_workload(spec: str, batch: int | None, seq_len: int | None) -> Workload:
    """The model `spec` names with its example batch: the factory's own, else random tokens."""
    made = _made(spec)
    if made.get("example_inputs") is not None:
        if batch is not None or seq_len is not None:
            raise CommandLineError(f"--batch / --seq-len make random token inputs, but {spec} returned its own "
                                   "example_inputs; drop those flags, or return only the model")
        return Workload(**made)
    inputs = token_batch(made["model"], DEFAULT_BATCH if batch is None else batch, seq_len)
    return Workload(**{**made, "example_inputs": inputs})


def token_batch(model: torch.nn.Module, batch: int, seq_len: int | None) -> dict[str, torch.Tensor]:
    """`batch` rows of random ids in the model's vocabulary (seeded: the same plan every run)."""
    config = getattr(model, "config", None)
    vocab = getattr(config, "vocab_size", None)
    if not isinstance(vocab, int):
        raise CommandLineError(f"{type(model).__name__} has no config.vocab_size to draw token ids from; "
                               "return (model, example_inputs) from the factory")
    positions = getattr(config, "max_position_embeddings", None)
    length = seq_len if seq_len is not None else min(DEFAULT_SEQ_LEN, positions or DEFAULT_SEQ_LEN)
    if positions is not None and length > positions:
        raise CommandLineError(f"--seq-len {length} is longer than the {positions} positions "
                               f"{type(model).__name__} has (max_position_embeddings); give at most {positions}")
    ids = torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "labels": ids}


def _made(spec: str) -> dict[str, Any]:
    """`sw.plan`'s keywords (some of KEYS) from a config file or a factory."""
    if spec.endswith(".json") or Path(spec).exists():
        return {"model": model_from_config(Path(spec))}
    module_name, _, factory_name = spec.partition(":")
    if module_name and factory_name:
        return _unpacked(_call(_factory(module_name, factory_name, spec), spec), spec)
    raise CommandLineError(f"model {spec!r} is neither a file nor module:factory; give a Hugging Face config.json "
                           "(or its folder), or module:factory, e.g. mymodels:build for a function build() in "
                           "mymodels.py that returns the model")


def named_function(spec: str, role: str) -> Callable[..., Any]:
    """The function or class `module:name` names, its module imported (the user names their own
    code: `stagewise inspect --trusted`); `role` says what it is for in an error."""
    module_name, _, name = spec.partition(":")
    if not (module_name and name):
        raise CommandLineError(f"{role} {spec!r} is not module:function; give e.g. mylosses:lm_loss for a function "
                               "lm_loss in mylosses.py")
    return _factory(module_name, name, spec, role)


def _factory(module_name: str, factory_name: str, spec: str, role: str = "model") -> Callable[..., Any]:
    module = _imported(module_name, spec, role)
    factory = getattr(module, factory_name, None)
    if not callable(factory):
        found = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))[:8]
        raise CommandLineError(f"{role} {spec!r}: {module_name} has no function {factory_name!r}; "
                               f"it has {', '.join(found) or 'no public functions'}")
    return factory


def _imported(module_name: str, spec: str, role: str) -> ModuleType:
    """The module, found in the current folder first (the console script's path does not hold it)."""
    if module_name.endswith(".py") or os.sep in module_name:
        stem = Path(module_name).stem
        raise CommandLineError(f"{role} {spec!r}: write the module's import name, not its file: "
                               f"{stem}:{spec.partition(':')[2]}, run from the folder that holds {stem}.py")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        if error.name is not None and (module_name + ".").startswith(error.name + "."):
            raise CommandLineError(f"{role} {spec!r}: no module {error.name!r} in {os.getcwd()} or the installed "
                                   "packages; run from the folder that holds it, or install it") from error
        raise CommandLineError(f"{role} {spec!r}: importing {module_name} failed ({first_line(error)}); "
                               "install what it imports") from error
    except Exception as error:  # noqa: BLE001 - the user's module failed: said in one line, --debug shows it
        raise CommandLineError(f"{role} {spec!r}: importing {module_name} raised {first_line(error)}; "
                               "fix the module (--debug shows the traceback)") from error


def _call(factory: Callable[[], Any], spec: str) -> Any:
    try:
        return factory()
    except Exception as error:  # noqa: BLE001 - the user's factory failed: said in one line, --debug shows it
        raise CommandLineError(f"model {spec!r}: the factory raised {first_line(error)}; fix it "
                               "(--debug shows the traceback)") from error


def _unpacked(made: Any, spec: str) -> dict[str, Any]:
    """The factory's result as sw.plan's keywords."""
    if isinstance(made, torch.nn.Module):
        return {"model": made}
    if isinstance(made, tuple) and len(made) == 2 and isinstance(made[0], torch.nn.Module):
        return {"model": made[0], "example_inputs": made[1]}
    if isinstance(made, Mapping) and isinstance(made.get("model"), torch.nn.Module) and set(made) <= set(KEYS):
        return dict(made)
    got = f"a dict of {sorted(made)}" if isinstance(made, Mapping) else f"an object of type {type(made).__name__}"
    raise CommandLineError(f"model {spec!r}: the factory returned {got}; return {_RETURNS}")
