"""The docs stay true to the tree: docs/code-map.md lists every module of the package, every path
and every `stagewise.` name the README, docs/, docs/guide/ and bench/README.md mention exists, every
link stays inside the repository, and the pages a user reads keep short lines. That their code
runs and prints what they show is tests/test_doc_examples.py.
"""

from __future__ import annotations

import importlib
import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("ir", "compiler", "passes", "codegen", "runtime", "cli")
USER_DOCS = (ROOT / "README.md", *sorted((ROOT / "docs" / "guide").glob("*.md")), ROOT / "bench" / "README.md")
DOCS = (*USER_DOCS, *sorted((ROOT / "docs").glob("*.md")))
MAX_LINE = 110  # the pages a user reads stay readable in a terminal and a diff
CODE_MAP = ROOT / "docs" / "code-map.md"

_FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)
_CODE_SPAN = re.compile(r"`[^`\n]*`")
_LINK = re.compile(r"\[[^\]\n]*\]\(([^)\s]+)\)")
# a repository path as the docs write it: starts at a top-level folder, not inside another path or URL
_PATH = re.compile(r"(?<![\w./~-])((?:ir|compiler|passes|codegen|runtime|cli|stagewise|tests|bench|examples|scripts|docs|\.ci)"
                   r"/[\w.*/-]*)")
_DOTTED = re.compile(r"(?<![\w.])stagewise(?:\.\w+)+(?!\w)(?<!\.json)")  # not the file stagewise.json


def _prose(text: str) -> str:
    """The text without fenced blocks and code spans, where a link is a link."""
    return _CODE_SPAN.sub("", _FENCE.sub("", text))


def _links(doc: Path) -> list[str]:
    return _LINK.findall(_prose(doc.read_text()))


def _target(doc: Path, link: str) -> str:
    """A relative link as a repository path (normalised, symlinks not followed)."""
    return Path(os.path.relpath(os.path.normpath(doc.parent / link.partition("#")[0]), ROOT)).as_posix()


def _package_files() -> list[str]:
    files = [p for package in PACKAGES for p in (ROOT / package).rglob("*.py") if "__pycache__" not in p.parts]
    files += (ROOT / "stagewise").glob("*.py")  # not into its symlinks: those are the packages above
    return sorted(p.relative_to(ROOT).as_posix() for p in files)


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: d.relative_to(ROOT).as_posix())
def test_links_stay_inside_the_repository(doc: Path) -> None:
    problems = []
    for link in _links(doc):
        if re.match(r"[a-z][a-z0-9+.-]*:", link) or link.startswith("/"):
            problems.append(f"{link}: not a relative link (the docs link only to files of this repository)")
            continue
        if not link.partition("#")[0]:
            continue  # an anchor in the same file
        target = _target(doc, link)
        if target == ".." or target.startswith("../"):
            problems.append(f"{link}: leaves the repository")
        elif not (ROOT / target).exists():
            problems.append(f"{link}: {target} does not exist")
    assert not problems, f"{doc.name}:\n  " + "\n  ".join(problems)


def _anchors(doc: Path) -> set[str]:
    """The anchors GitHub makes of a markdown file's headings (fenced blocks aside)."""
    headings = re.findall(r"^#+ (.*)$", _FENCE.sub("", doc.read_text()), re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-") for heading in headings}


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: d.relative_to(ROOT).as_posix())
def test_links_to_a_heading_find_it(doc: Path) -> None:
    broken = []
    for link in _links(doc):
        path, _, anchor = link.partition("#")
        target = ROOT / _target(doc, path) if path else doc
        if anchor and target.suffix == ".md" and target.exists() and anchor not in _anchors(target):
            broken.append(link)
    assert not broken, f"{doc.name} links to headings that do not exist: {broken}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: d.relative_to(ROOT).as_posix())
def test_named_paths_exist(doc: Path) -> None:
    missing = []
    for path in _PATH.findall(doc.read_text()):
        path = path.rstrip(".,:;")
        if not ((ROOT / path).exists() or ("*" in path and any(ROOT.glob(path)))):
            missing.append(path)
    assert not missing, f"{doc.name} names paths that do not exist: {sorted(set(missing))}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: d.relative_to(ROOT).as_posix())
def test_named_modules_and_attributes_exist(doc: Path) -> None:
    missing = [name for name in sorted(set(_DOTTED.findall(doc.read_text()))) if not _resolves(name)]
    assert not missing, f"{doc.name} names what stagewise does not have: {missing}"


def _resolves(dotted: str) -> bool:
    """Whether `dotted` is a module of stagewise, or an attribute reached from one."""
    parts = dotted.split(".")
    for split in range(len(parts), 0, -1):
        try:
            value = importlib.import_module(".".join(parts[:split]))
        except ModuleNotFoundError:
            continue
        for name in parts[split:]:
            if not hasattr(value, name):
                return False
            value = getattr(value, name)
        return True
    return False


def test_code_map_lists_every_module() -> None:
    listed = {_target(CODE_MAP, link) for link in _links(CODE_MAP)}
    missing = [path for path in _package_files() if path not in listed]
    assert not missing, f"add a line for each to docs/code-map.md: {missing}"


@pytest.mark.parametrize("doc", USER_DOCS, ids=lambda d: d.relative_to(ROOT).as_posix())
def test_user_docs_keep_short_lines(doc: Path) -> None:
    long = [number for number, line in enumerate(doc.read_text().splitlines(), 1) if len(line) > MAX_LINE]
    assert not long, f"{doc.name}: lines over {MAX_LINE} characters: {long}"


def test_readme_is_a_front_page() -> None:
    """At most 250 lines: what stagewise is, the commands, one example, where to read on."""
    lines = len((ROOT / "README.md").read_text().splitlines())
    assert lines <= 250, f"README.md has {lines} lines: move the detail to a page of docs/guide/"
