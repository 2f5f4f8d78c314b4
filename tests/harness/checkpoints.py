"""A pipeline's optimizer state by name, for comparing checkpoints and runs."""

from __future__ import annotations

import torch

import stagewise as sw


def optimizer_state(pipe: sw.Pipeline) -> dict[tuple[int, str, str], torch.Tensor]:
    """Every stage's optimizer state as (stage, parameter name, key) -> tensor; a swapped stage's
    state read from the host memory where it lives between steps."""
    found = {}
    for worker in pipe._workers:
        names = {id(p): n for n, p in worker.params.items()}
        for param, values in (worker.optimizer.state.items() if worker.optimizer else ()):
            for key, value in values.items():
                if value.numel() == 0:
                    value = worker.host[("optimizer", f"{names[id(param)]}.{key}")]
                found[(worker.stage.index, names[id(param)], key)] = value
    return found


def assert_optimizer_state_equal(got: dict, want: dict, exact: bool = False) -> None:
    assert set(got) == set(want) and want, f"optimizer state keys differ: {set(got) ^ set(want)}"
    for key, tensor in want.items():
        tol = {"rtol": 0, "atol": 0} if exact else {"rtol": 1e-5, "atol": 1e-6}
        torch.testing.assert_close(got[key], tensor, **tol, msg=lambda m, k=key: f"{k}: {m}")
