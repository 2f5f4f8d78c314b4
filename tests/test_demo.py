"""The README's main job (examples/demo.py) runs to the end and trains like eager training."""

from __future__ import annotations

import contextlib
import io
import re
import runpy
from pathlib import Path

import torch
from transformers.utils import logging as hf_logging

DEMO = Path(__file__).resolve().parent.parent / "examples" / "demo.py"


def test_demo_runs_and_matches_eager() -> None:
    """The script run as __main__ in this process, as a user's `python examples/demo.py` runs it (a fresh
    interpreter would spend 5 of its 10 CPU-seconds importing what this one has); what it sets for the
    whole process (the intra-op threads, transformers' verbosity, the seed) is put back after it."""
    printed, threads, verbosity = io.StringIO(), torch.get_num_threads(), hf_logging.get_verbosity()
    try:
        with contextlib.redirect_stdout(printed), torch.random.fork_rng():
            runpy.run_path(str(DEMO), run_name="__main__")
    finally:
        torch.set_num_threads(threads)
        hf_logging.set_verbosity(verbosity)
    out = printed.getvalue()
    assert "where the time went" in out and "predicted step" in out
    assert re.search(r"the (model|runtime) dominates: compute \d+% .* dispatch \d+%", out), out[-2000:]
    difference = re.search(r"largest parameter difference after \d+ steps: ([0-9.e+-]+)", out)
    assert difference is not None and float(difference[1]) < 1e-5, out[-2000:]
