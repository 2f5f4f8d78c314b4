"""The size rules of the project's standards, checked: no module of the package, bench/ or examples/
over 400 lines, no function over 60 lines of code (its docstring, which item 4 of issue 22 asks to
carry Args / Returns / Raises and an example, not counted)."""

from __future__ import annotations

import ast
import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODULE_LINES, FUNCTION_LINES = 400, 60


def checked_files() -> list[Path]:
    """The package's modules (its symlinked subpackages followed), bench/'s and examples/'."""
    files = [Path(d, f) for top in ("stagewise", "bench", "examples")
             for d, _, names in os.walk(ROOT / top, followlinks=True) if "__pycache__" not in d
             for f in names if f.endswith(".py")]
    return sorted(files)


def code_lines(function: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """A function's lines, its docstring left out."""
    lines = function.end_lineno - function.lineno + 1  # type: ignore[operator]  # set by ast.parse
    first = function.body[0]
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
        lines -= first.end_lineno - first.lineno + 1  # type: ignore[operator]  # set by ast.parse
    return lines


def oversized(path: Path) -> list[str]:
    """What in `path` breaks a size rule, as 'file: what (lines)'."""
    source = path.read_text()
    name = path.relative_to(ROOT)
    found = [f"{name}: the module ({len(source.splitlines())})"] if len(source.splitlines()) > MODULE_LINES else []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and code_lines(node) > FUNCTION_LINES:
            found.append(f"{name}: {node.name} ({code_lines(node)})")
    return found


def test_no_module_or_function_over_its_size():
    files = checked_files()
    assert len(files) > 150  # the whole package, symlinks followed
    found = [hit for path in files for hit in oversized(path)]
    assert not found, f"split these (modules at most {MODULE_LINES} lines, functions {FUNCTION_LINES}): {found}"


def test_the_rule_counts_code_not_docstrings(tmp_path: Path):
    body = "\n".join(f"    x{i} = {i}" for i in range(FUNCTION_LINES))
    probe = tmp_path / "probe.py"
    probe.write_text(f'def documented():\n    """{"line" + chr(10) * 20}"""\n{body}\n\ndef long():\n    y = 0\n{body}\n')
    functions = {f.name: code_lines(f) for f in ast.parse(probe.read_text()).body if isinstance(f, ast.FunctionDef)}
    assert functions == {"documented": FUNCTION_LINES + 1, "long": FUNCTION_LINES + 2}
