"""bench/runtime_vs_pippy.py's two models: each runs at its own sizes and steps unless the command
line sets them, and an unknown model is refused (the timed run itself needs two processes: not a test)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import runtime_vs_pippy as bench  # noqa: E402 - bench/ is on sys.path only from here


def test_each_model_runs_at_its_own_sizes_and_steps():
    args = bench.parse_args([])
    assert args.models == ["small", "large"]
    small, large = (bench.model_args(args, name) for name in args.models)
    assert (small.dim, small.seq, small.steps) == (128, 64, 60)
    assert (large.dim, large.seq, large.vocab, large.steps) == (256, 128, 2048, 15)
    assert large.batch == small.batch and large.microbatches == small.microbatches  # the same minibatch split


def test_the_command_line_sets_every_models_sizes_and_steps():
    args = bench.parse_args(["--models", "large", "--dim", "64", "--steps", "5"])
    large = bench.model_args(args, "large")
    assert (large.model, large.dim, large.seq, large.steps) == ("large", 64, 128, 5)
    assert bench.model_args(bench.parse_args(["--quick"]), "small").steps == 3


def test_an_unknown_model_is_refused(capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(["--models", "small,huge"])
    assert "unknown model 'huge'" in capsys.readouterr().err
