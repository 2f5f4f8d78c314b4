"""The flags `plan` and `recommend` share (the model, its batch, precision, optimizer, catalogue), and
the argparse types that turn a flag's text into a checked value, so a bad value is a usage error
before any model is built."""

from __future__ import annotations

import argparse
import functools
import re
from collections.abc import Callable, Sequence

import torch

from stagewise.cli.models import DEFAULT_BATCH, DEFAULT_SEQ_LEN
from stagewise.ir.precision import PRECISIONS

OPTIMIZERS: dict[str, Callable[..., torch.optim.Optimizer]] = {"adamw": torch.optim.AdamW, "sgd": torch.optim.SGD}
_DURATION = re.compile(r"\s*([0-9]*\.?[0-9]+)\s*(s|min|h|d)?\s*")
_SECONDS = {None: 1.0, "s": 1.0, "min": 60.0, "h": 3600.0, "d": 86400.0}


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", metavar="MODEL",
                        help="a Hugging Face config.json (or its folder), built on the meta device; or "
                             "module:factory, a function returning the model, (model, example_inputs) or a dict "
                             "of sw.plan's model, example_inputs, loss_fn, example_target")
    parser.add_argument("--batch", type=positive_int, metavar="B",
                        help=f"rows of random token ids when the factory gives no inputs (default {DEFAULT_BATCH})")
    parser.add_argument("--seq-len", type=positive_int, metavar="T",
                        help=f"tokens per row (default {DEFAULT_SEQ_LEN}, or the model's positions where fewer)")


def add_training_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--precision", choices=PRECISIONS, default="fp32",
                        help="what the devices compute in: their peak FLOP/s for it (default fp32)")
    parser.add_argument("--optimizer", choices=tuple(OPTIMIZERS), default="adamw",
                        help="whose state the devices hold (default adamw: two moments per weight)")
    parser.add_argument("--lr", type=positive_float, default=1e-3, help="the optimizer's learning rate (default 1e-3)")
    parser.add_argument("--catalogue", metavar="FILE",
                        help="a .toml or .json catalogue of your devices, merged over the shipped one")


def optimizer_factory(name: str, lr: float) -> Callable[..., torch.optim.Optimizer]:
    """What sw.plan takes as `optimizer=`: a factory of parameters (a partial, so a plan could be saved)."""
    return functools.partial(OPTIMIZERS[name], lr=lr)


def listed(values: Sequence[str] | None) -> list[str]:
    """Repeated and comma-separated values as one list: ['8xH100', 'p4d.24xlarge,A100'] -> three."""
    return [part.strip() for value in values or () for part in value.split(",") if part.strip()]


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be at least 1")
    return value


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} must be a positive number")
    return value


def duration(text: str) -> float:
    """Seconds from '5400', '90min', '36h' or '2d'."""
    match = _DURATION.fullmatch(text)
    if match is None or float(match.group(1)) <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a duration; write seconds or e.g. 90min, 36h, 2d")
    return float(match.group(1)) * _SECONDS[match.group(2)]
