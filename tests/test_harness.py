"""No test file imports another: what several share lives in tests/harness/ (or tests/reference.py,
tests/hf.py, tests/training_problems.py, tests/models/), so a test file is read, run and changed alone."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.harness.slow import SLOW_FILES

TESTS = Path(__file__).resolve().parent


def imported_test_files(source: str) -> list[str]:
    """The modules named test_* that `source` imports, at any depth, absolutely or relatively."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            names = [f"{module}.{alias.name}" for alias in node.names] if module in ("", "tests") else [module]
        else:
            continue
        found += [name for name in names if any(part.startswith("test_") for part in name.split("."))]
    return found


def test_the_check_sees_every_form_of_import():
    sources = ["from tests.test_distributed import spawn", "import tests.test_cuda",
               "def f():\n    from .test_save_load import optimizer_state", "from tests import test_simulator"]
    assert [imported_test_files(s) for s in sources] == [
        ["tests.test_distributed"], ["tests.test_cuda"], ["test_save_load"], ["tests.test_simulator"]]
    assert imported_test_files("from tests.harness.ranks import spawn\nimport tests.reference") == []


def test_no_test_file_imports_another():
    importing = {str(path.relative_to(TESTS)): names for path in sorted(TESTS.rglob("*.py"))
                 if (names := imported_test_files(path.read_text()))}
    assert importing == {}, f"move what they share into tests/harness/: {importing}"


def test_every_file_marked_slow_is_a_test_file():
    """A renamed file would otherwise drop out of the slow marker, and into the quick loop, silently."""
    assert sorted(SLOW_FILES - {path.name for path in TESTS.glob("test_*.py")}) == []
