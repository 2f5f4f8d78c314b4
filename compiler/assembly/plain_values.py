"""Whether a value read from a checkpoint may stand where the object it is loaded into has its own.

Why: training.pt is untrusted (an attacker rewrites it and reseals the marker), and its optimizer
hyper-parameters and scheduler state become the attributes of objects that run at every step: an
`lr` of "0.1" would fail the next step midway, a scheduler entry it does not have would become a
new attribute. Comparing each saved value with the value the object itself holds (or its class's
default) refuses both where the checkpoint is read.
"""

from __future__ import annotations

import torch


def is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def same_kind(saved: object, live: object) -> bool:
    """Whether a saved value may stand where `live` (the freshly made object's own) stands: numbers
    for numbers (an int for a float), a bool for a bool, lists and tables of the same length and
    keys whose items are alike; where `live` is None, None or a plain scalar."""
    if live is None:
        return saved is None or isinstance(saved, bool | int | float | str)
    if isinstance(live, bool) or isinstance(saved, bool):
        return isinstance(live, bool) and isinstance(saved, bool)
    if isinstance(live, int | float | torch.Tensor):
        return is_number(saved) or isinstance(saved, torch.Tensor) and saved.numel() == 1
    if isinstance(live, list | tuple):
        return (isinstance(saved, list | tuple) and len(saved) == len(live)
                and all(same_kind(s, v) for s, v in zip(saved, live, strict=True)))
    if isinstance(live, dict):
        return isinstance(saved, dict) and set(saved) == set(live) and all(same_kind(saved[k], live[k]) for k in live)
    return type(saved) is type(live)
