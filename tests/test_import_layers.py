"""The packages' layering holds without exceptions: no module of stagewise imports another inside a
function or a class body, where an import can hide a cycle that the import-linter contract
(pyproject.toml) would otherwise refuse, and the subpackages of compiler/ are the ones the contract
layers (a new one must be placed in it, and in docs/code-map.md)."""

from __future__ import annotations

import ast
import os
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "stagewise"


def source_files() -> list[Path]:
    """Every .py file of the installed package, the symlinked top-level subpackages followed."""
    return sorted(Path(d, f) for d, _, files in os.walk(PACKAGE, followlinks=True) if "__pycache__" not in d
                  for f in files if f.endswith(".py"))


def stagewise_import(node: ast.AST) -> bool:
    """An import statement of a stagewise module (absolute, or relative, which is one by definition)."""
    if isinstance(node, ast.ImportFrom):
        return node.level > 0 or (node.module or "").split(".")[0] == "stagewise"
    if isinstance(node, ast.Import):
        return any(alias.name.split(".")[0] == "stagewise" for alias in node.names)
    return False


def nested_imports(path: Path) -> list[int]:
    """The lines of `path`'s stagewise imports inside a function or class body."""
    tree = ast.parse(path.read_text(), str(path))
    return sorted({node.lineno for scope in ast.walk(tree)
                   if isinstance(scope, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
                   for node in ast.walk(scope) if stagewise_import(node)})


def test_no_stagewise_import_inside_a_function_or_class():
    files = source_files()
    assert len(files) > 100  # the whole package, symlinks followed
    found = [f"{path.relative_to(PACKAGE)}:{line}" for path in files for line in nested_imports(path)]
    assert not found, f"imports inside functions or classes (move them to the top; a cycle is a layering bug): {found}"


def test_the_detector_sees_a_nested_import(tmp_path: Path):
    probe = tmp_path / "probe.py"
    probe.write_text("import stagewise\n\ndef f():\n    from stagewise.ir import plan\n\nclass C:\n    from . import x\n")
    assert nested_imports(probe) == [4, 7]  # the top-level import is where imports belong


def test_every_compiler_subpackage_is_layered_and_mapped():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    (contract,) = [c for c in config if c.get("containers") == ["stagewise.compiler"]]
    layered = {name.strip() for layer in contract["layers"] for name in layer.split("|")}
    packages = {p.name for p in (ROOT / "compiler").iterdir() if (p / "__init__.py").is_file()}
    assert packages == layered, "compiler/'s subpackages and the import-linter contract's layers differ"
    modules = [p for p in (ROOT / "compiler").glob("*.py") if p.name != "__init__.py"]
    assert not modules, f"compiler/ holds modules outside its packages: {modules}"
    code_map = (ROOT / "docs" / "code-map.md").read_text()
    assert all(f"compiler/{name}/" in code_map for name in packages), "docs/code-map.md lacks a package"
