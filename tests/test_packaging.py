"""The layout is honest: a wheel and the editable install expose the same modules and nothing but the
package, `import stagewise` works from anywhere, and every module of the repository is imported once,
under its one proper name (no second copy under the clone's folder name or a subpackage's bare name)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path, PurePosixPath

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "stagewise"
NOT_SHIPPED = ("tests", "bench", "examples", "scripts")  # folders of the repository, never subpackages
# What an editable install exposes, seen from a process outside the repository: where `stagewise`
# comes from, the modules pkgutil finds, and the .py files under the package's directories (the
# symlinked subpackages followed), relative to the package's parent.
INSTALLED_VIEW = """
import json, os, pkgutil, stagewise
def fail(name): raise ImportError(f"pkgutil could not import {name}")
(top,) = stagewise.__path__
files = [os.path.relpath(os.path.join(d, f), os.path.dirname(top))
         for d, dirs, names in os.walk(top, followlinks=True) if "__pycache__" not in d
         for f in names if f.endswith(".py")]
walked = [m.name for m in pkgutil.walk_packages(stagewise.__path__, "stagewise.", onerror=fail)]
print(json.dumps({"file": stagewise.__file__, "files": files, "walked": walked}))
"""


def module_name(relative: PurePosixPath) -> str:
    """stagewise/ir/plan.py -> stagewise.ir.plan; stagewise/ir/__init__.py -> stagewise.ir."""
    parts = relative.with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def untracked(directory: str, names: list[str]) -> set[str]:
    """What the copy for the wheel build leaves out: caches, build outputs and, at the root, the
    virtual environment, git's store and the ignored out/ (as .gitignore does)."""
    anywhere = {n for n in names if n == "__pycache__" or n.endswith((".egg-info", "_cache"))}
    at_root = {".git", ".venv", "build", "out", ".hypothesis"} if Path(directory) == ROOT else set()
    return anywhere | (at_root & set(names))


def build_wheel(destination: Path) -> zipfile.ZipFile:
    """Build the wheel of a copy of this checkout (the build writes build/ and *.egg-info next to the
    sources, and a stale build/ would let deleted modules into the wheel)."""
    source = destination / "source"
    shutil.copytree(ROOT, source, symlinks=True, ignore=untracked)
    dist = destination / "dist"
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                            "-w", str(dist), str(source)], capture_output=True, text=True, check=False)
    assert built.returncode == 0, built.stdout + built.stderr
    (wheel,) = dist.glob(f"{PACKAGE}-*.whl")
    return zipfile.ZipFile(wheel)


@pytest.fixture(scope="module")
def wheel_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes]:
    with build_wheel(tmp_path_factory.mktemp("wheel")) as wheel:
        return {name: wheel.read(name) for name in wheel.namelist()}


@pytest.fixture(scope="module")
def wheel_entries(wheel_files: dict[str, bytes]) -> list[str]:
    return list(wheel_files)


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The editable install as a fresh interpreter sees it from a folder outside the repository."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    run = subprocess.run([sys.executable, "-c", INSTALLED_VIEW], cwd=tmp_path_factory.mktemp("elsewhere"),
                         env=env, capture_output=True, text=True, check=False)
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout.splitlines()[-1])


def shipped_elsewhere(modules: set[str]) -> set[str]:
    """Modules that are repository folders posing as subpackages (stagewise.tests, ...)."""
    return {m for m in modules for folder in NOT_SHIPPED
            if m == f"{PACKAGE}.{folder}" or m.startswith(f"{PACKAGE}.{folder}.")}


def test_import_stagewise_from_another_folder(installed: dict):
    assert Path(installed["file"]).resolve() == (ROOT / PACKAGE / "__init__.py").resolve()


def test_wheel_holds_only_the_package(wheel_entries: list[str]):
    strays = [e for e in wheel_entries if not e.startswith((f"{PACKAGE}/", f"{PACKAGE}-"))]
    assert not strays, f"the wheel installs more than {PACKAGE}/: {strays}"
    assert f"{PACKAGE}/py.typed" in wheel_entries
    assert f"{PACKAGE}/catalogue/data.json" in wheel_entries  # the shipped device catalogue
    assert {f"{PACKAGE}/cli/main.py", f"{PACKAGE}/__main__.py"} <= set(wheel_entries)  # the command line


def test_wheel_installs_the_stagewise_command(wheel_files: dict[str, bytes]):
    (entry_points,) = [data for name, data in wheel_files.items() if name.endswith(".dist-info/entry_points.txt")]
    assert "[console_scripts]\nstagewise = stagewise.cli.main:main" in entry_points.decode()


def test_wheel_and_editable_install_expose_the_same_modules(wheel_entries: list[str], installed: dict):
    in_wheel = {module_name(PurePosixPath(e)) for e in wheel_entries
                if e.startswith(f"{PACKAGE}/") and e.endswith(".py")}
    editable_files = {module_name(PurePosixPath(Path(f).as_posix())) for f in installed["files"]}
    editable_walked = {PACKAGE, *installed["walked"]}
    assert len(in_wheel) > 20  # the whole package, not an empty or partial build
    assert not shipped_elsewhere(in_wheel | editable_files | editable_walked)
    assert sorted(editable_files ^ in_wheel) == [], "in the editable install or the wheel only"
    # pkgutil finds a subpackage only through its __init__.py: this also catches a folder that lacks one
    assert sorted(editable_walked ^ in_wheel) == [], "found by pkgutil or in the wheel only"


def expected_names() -> dict[Path, str]:
    """The one proper module name of each .py file of the package (symlinks followed), of tests/ and of
    examples/ (tests import an example's functions as `examples.<name>`); bench/ is a folder of
    scripts, on sys.path when run or tested (`_common`, `gpu_step`)."""
    names = {path.resolve(): path.stem for path in (ROOT / "bench").glob("*.py")}
    for top in (ROOT / PACKAGE, ROOT / "tests", ROOT / "examples"):
        for directory, _, files in os.walk(top, followlinks=True):
            for file in files:
                if file.endswith(".py"):
                    path = Path(directory, file)
                    names[path.resolve()] = module_name(PurePosixPath(path.relative_to(ROOT).as_posix()))
    return names


def repository_file(path: Path) -> bool:
    """A file of the checkout, not of a virtual environment inside it (.venv/ holds torch, pytest, ...)."""
    return (path.is_relative_to(ROOT) and not path.is_relative_to(Path(sys.prefix).resolve())
            and "site-packages" not in path.parts)


def test_every_module_of_the_repository_is_imported_once_under_its_name():
    assert __name__ == "tests.test_packaging" and "tests.conftest" in sys.modules
    expected = expected_names()
    wrong = {}
    for name, module in list(sys.modules.items()):
        file = getattr(module, "__file__", None)
        if file is None:  # a namespace package, e.g. the clone's folder imported as a package
            if any(Path(p).resolve() == ROOT for p in getattr(module, "__path__", ())):
                wrong[name] = "the repository root as a namespace package"
            continue
        path = Path(file).resolve()  # a relative __file__ (torch.ops: "_ops.py") names no file of ours
        if Path(file).is_absolute() and repository_file(path) and expected.get(path) != name:
            wrong[name] = f"{path.relative_to(ROOT)} should be imported as {expected.get(path)}"
    assert not wrong, wrong
