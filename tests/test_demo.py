"""The README's main job (examples/demo.py) runs to the end and trains like eager training."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

DEMO = Path(__file__).resolve().parent.parent / "examples" / "demo.py"


def test_demo_runs_and_matches_eager() -> None:
    done = subprocess.run([sys.executable, str(DEMO)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    assert "where the time went" in out and "predicted step" in out
    assert re.search(r"the (model|runtime) dominates: compute \d+% .* dispatch \d+%", out), out[-2000:]
    difference = re.search(r"largest parameter difference after \d+ steps: ([0-9.e+-]+)", out)
    assert difference is not None and float(difference[1]) < 1e-5, out[-2000:]
