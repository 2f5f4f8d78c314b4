"""examples/elastic.py run in this process, never interrupted: the reference the elastic tests
(tests/test_elastic.py on loopback, tests/test_two_hosts.py across two namespace hosts) hold a
job that lost ranks or a host to."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import re
from pathlib import Path

import torch

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "elastic.py"
LINE = re.compile(r"step (\d+) loss ([0-9.]+) world (\d+)")  # what the example prints per step


def run_uninterrupted(args: list[str], final: Path) -> tuple[dict, list[tuple[str, str]]]:
    """The example's final state (saved to `final`) and its (step, loss) lines, run with `args` on one
    device in this process, the caller's random state left as it was."""
    spec = importlib.util.spec_from_file_location("elastic_example", EXAMPLE)
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    printed = io.StringIO()
    with torch.random.fork_rng(), contextlib.redirect_stdout(printed):
        example.main([*args, "--final", str(final)])
    return torch.load(final), [(step, loss) for step, loss, _ in LINE.findall(printed.getvalue())]
