"""Model factories that tests/test_cli.py names on the command line as `tests.cli_factories:NAME`."""

import torch

from tests.models.gpt import TinyGPT, lm_loss


def tiny_gpt() -> dict:
    """The tied GPT with its own batch and loss: the dict of sw.plan's keywords."""
    tokens = torch.randint(0, 64, (8, 16), generator=torch.Generator().manual_seed(0))
    return {"model": TinyGPT(), "example_inputs": (tokens,), "loss_fn": lm_loss, "example_target": tokens}


def hf_gpt2() -> torch.nn.Module:
    """A model alone: the command line draws token ids from its config's vocabulary."""
    # transformers only where needed: the error cases that import this module start faster
    from tests.hf import gpt2

    return gpt2(layers=2)


def broken() -> torch.nn.Module:
    raise RuntimeError("this factory fails on purpose")


def not_a_model() -> tuple:
    return ("model", "inputs", "and a third thing")
