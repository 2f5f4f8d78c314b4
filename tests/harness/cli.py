"""The command line run in the test's own process (tests/test_cli.py and the schedules' CLI checks)."""

from __future__ import annotations

from pathlib import Path

import pytest

from stagewise.cli.main import main


def stagewise_here(capsys: pytest.CaptureFixture, *args: str | Path) -> tuple[int, str, str]:
    """The command through `main` in this process: (exit status, stdout, stderr)."""
    status = main([str(arg) for arg in args])
    out, err = capsys.readouterr()
    return status, out, err
