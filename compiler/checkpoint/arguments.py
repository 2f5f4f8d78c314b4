"""The arguments of `pipe.save`, `sw.load` and `sw.Checkpoints`, checked where they enter: each mistake named.

A checkpoint is a folder of its own: save writes beside it and renames it into place, so a path
naming no folder ('', '.') or one holding the current directory would replace what the user works
in; such paths are refused before anything is written. `trusted_functions` is a list of the user's
functions (a bare function or a string would be read as characters or fail deep in the load).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path

from stagewise.ir.errors import CheckpointError, OptionError


def checkpoint_path(directory: object, call: str) -> Path:
    """`directory` as a Path; CheckpointError for what is not a path (None, a number)."""
    if not isinstance(directory, str | os.PathLike):
        raise CheckpointError(f"{call} takes the checkpoint's directory as a str or pathlib.Path, got "
                              f"{type(directory).__name__} {directory!r}; give a path such as 'checkpoints/run1'")
    if str(directory) == "":
        raise CheckpointError(f"{call}('') names no directory: give the checkpoint's folder, such as 'checkpoints/run1'")
    return Path(directory)


def save_path(directory: object, call: str = "pipe.save") -> Path:
    """`directory` as a folder save may fill or replace: named, and not holding the current directory."""
    path = checkpoint_path(directory, call)
    resolved, here = path.resolve(), Path.cwd().resolve()
    if here == resolved or resolved in here.parents:
        raise CheckpointError(f"{call}({str(directory)!r}) names {resolved}, which holds the current directory: a "
                              "checkpoint replaces its folder; give it a folder of its own, such as 'checkpoints/run1'")
    return path


def checkpoints_folder(directory: object) -> Path:
    """`sw.Checkpoints`' directory: a folder that is there or can be made, not a file (nor under one). It
    holds the checkpoints (`step_<n>`), so the current directory will do."""
    path = checkpoint_path(directory, "sw.Checkpoints")
    existing = next((p for p in (path, *path.parents) if p.exists()), None)
    if existing is not None and not existing.is_dir():
        raise CheckpointError(f"sw.Checkpoints({str(directory)!r}): {existing} is a file, not a folder; give "
                              "a directory for the checkpoints (it is made if absent), such as 'checkpoints'")
    return path


def trusted_functions(functions: object) -> tuple[Callable, ...]:
    """`sw.load`'s trusted_functions as a tuple of callables; OptionError naming what else it got."""
    if callable(functions):
        raise OptionError(f"trusted_functions takes a list of functions, got the function {functions!r} alone: "
                          "write trusted_functions=[fn]")
    if isinstance(functions, str | bytes) or not isinstance(functions, Sequence | set | frozenset):
        raise OptionError(f"trusted_functions takes a list of functions (those of yours the stage code calls, a "
                          f"loss_fn), got {type(functions).__name__} {functions!r}")
    wrong = [f for f in functions if not callable(f)]
    if wrong:
        raise OptionError(f"trusted_functions holds {wrong[0]!r}, a {type(wrong[0]).__name__}, not a function: give "
                          "the functions themselves (trusted_functions=[my_loss]), not their names")
    return tuple(functions)
