"""bench/zero_bubble_vs_pippy.py's layout: both systems cut each kind of schedule at the same blocks, ZB-V's
four stages sit in a V over the two ranks, and an unknown kind is refused (the timed run needs two
processes: not a test)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import zero_bubble_vs_pippy as bench  # noqa: E402 - bench/ is on sys.path only from here


def test_zb_v_refines_the_two_stage_cut_and_places_its_stages_in_a_v():
    assert bench.cuts("1f1b", 8) == bench.cuts("zb-h1", 8) == [4]
    assert bench.cuts("zb-v", 8) == [2, 4, 6]  # the middle cut kept: each half is two of the V's stages
    held = [bench.local_stages("zb-v", rank) for rank in range(bench.RANKS)]
    assert held == [[0, 3], [1, 2]]  # rank 0 holds the first and the last stage
    assert [bench.local_stages("zb-h1", rank) for rank in range(bench.RANKS)] == [[0], [1]]


def test_each_model_runs_at_its_own_sizes_and_every_kind_by_default():
    args = bench.parse_args(["--models", "small,large"])
    assert args.kinds == ["1f1b", "zb-h1", "zb-v"]
    small, large = (bench.base.model_args(args, name) for name in args.models)
    assert (small.dim, large.dim, small.steps) == (128, 256, 20)


def test_an_unknown_kind_is_refused(capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(["--kinds", "1f1b,zb-2p"])
    assert "unknown schedule kind 'zb-2p'" in capsys.readouterr().err


def test_a_refused_schedule_is_a_row_of_its_own_and_the_ratios_compare_like_kinds():
    from rich.console import Console

    args = bench.base.model_args(bench.parse_args(["--quick"]), "small")
    timed = {"stagewise": bench.Result("sw", times=[0.2, 0.3, 0.2], losses=[2.0]),
             "torch": bench.Result("torch", times=[0.3, 0.3, 0.4], losses=[2.0])}
    refused = {"stagewise": bench.Result("sw", times=[0.1], losses=[2.0]),
               "torch": bench.Result("", error="RuntimeError: not under gloo")}
    console = Console(width=200, record=True)
    bench.report_model(console, args, {"1f1b": timed, "zb-v": refused})
    text = console.export_text()
    assert "refused: RuntimeError: not under gloo" in text
    assert "1.500x" in text  # torch's median 0.3 s over stagewise's 0.2 s
    assert "2.000x" in text  # stagewise zb-v's 0.1 s against its own 1f1b's 0.2 s
