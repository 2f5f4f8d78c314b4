"""Every code block of README.md, docs/guide/*.md and bench/README.md runs here, and the output shown after
it is what it prints: the docs cannot drift from the code.

A page's python blocks run in order in one namespace (as cells of a notebook), in a fresh temporary
folder, with stdout captured. A fenced block right after a run python block is its output and must
match what the block printed:
- a line `...` stands for any number of lines (an elision);
- numbers are compared within `NUMBER_TOLERANCE` (relative), the rest of the line exactly,
  trailing spaces aside.
A block that cannot run here (it needs torchrun, a GPU, a shell command, or it is a fragment) carries
`<!-- not run: <reason> -->` on the line before it. `NOT_RUN` counts those per page, so a block
that stops running (or a new one that never did) fails until it is counted on purpose.
"""

from __future__ import annotations

import contextlib
import io
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = (ROOT / "README.md", *sorted((ROOT / "docs" / "guide").glob("*.md")), ROOT / "bench" / "README.md")
NUMBER_TOLERANCE = 1e-3
NOT_RUN = {  # page -> how many of its fenced blocks are marked `<!-- not run: ... -->`
    "README.md": 1,
    "docs/guide/checkpoints.md": 1,
    "docs/guide/errors.md": 1,
    "docs/guide/huggingface.md": 0,
    "docs/guide/performance.md": 0,
    "docs/guide/planning.md": 7,
    "docs/guide/reading-generated-code.md": 0,
    "docs/guide/schedules.md": 0,
    "docs/guide/training.md": 2,
    "bench/README.md": 0,
}

_BLOCK = re.compile(r"^(?P<marker><!-- not run: (?P<reason>[^>]*?) -->\n)?```(?P<lang>\w*)\n(?P<body>.*?)^```$",
                    re.MULTILINE | re.DOTALL)
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:e[-+]?\d+)?")


@dataclass(frozen=True)
class Block:
    """One fenced block of a page: its language, text, first line, whether it follows the block before
    it with only blank lines between, and, if it does not run, why."""

    lang: str
    body: str
    line: int
    adjacent: bool
    not_run: str | None


def blocks(page: Path) -> list[Block]:
    text = page.read_text()
    found, end = [], -1
    for m in _BLOCK.finditer(text):
        adjacent = end >= 0 and not text[end:m.start()].strip()
        found.append(Block(m["lang"], m["body"], text.count("\n", 0, m.start("body")), adjacent, m["reason"]))
        end = m.end()
    return found


def _page_id(page: Path) -> str:
    return page.relative_to(ROOT).as_posix()


def _numbers_match(expected: str, got: str) -> bool:
    """Equal but for numbers, which agree within NUMBER_TOLERANCE."""
    if _NUMBER.sub("#", expected) != _NUMBER.sub("#", got):
        return False
    pairs = zip(_NUMBER.findall(expected), _NUMBER.findall(got), strict=True)
    return all(math.isclose(float(e), float(g), rel_tol=NUMBER_TOLERANCE, abs_tol=NUMBER_TOLERANCE * 1e-3)
               for e, g in pairs)


def output_matches(expected: str, got: str) -> bool:
    """Whether `got` (printed) is `expected` (shown), with `...` lines eliding any lines."""
    want = [line.rstrip() for line in expected.strip("\n").splitlines()]
    have = [line.rstrip() for line in got.strip("\n").splitlines()]

    def match(i: int, j: int) -> bool:
        if i == len(want):
            return j == len(have)
        if want[i] == "...":
            return any(match(i + 1, k) for k in range(j, len(have) + 1))
        return j < len(have) and _numbers_match(want[i], have[j]) and match(i + 1, j + 1)

    return match(0, 0)


def test_output_matching_rules() -> None:
    """The comparison itself: elisions, tolerance, and that a real difference fails."""
    assert output_matches("step 0: loss 6.2408\n...\ndone", "step 0: loss 6.24081\na\nb\ndone")
    assert output_matches("a\n...\n", "a")
    assert not output_matches("step 0: loss 6.2408", "step 0: loss 6.3408")
    assert not output_matches("step 0: loss 6.2408", "step 0: cost 6.2408")
    assert not output_matches("a\nb", "a")


@pytest.mark.parametrize("page", PAGES, ids=_page_id)
def test_every_block_runs_or_is_counted(page: Path) -> None:
    """A block either runs (python) or says why not; the count of those is the one expected."""
    found = blocks(page)
    unmarked = [b.line for i, b in enumerate(found)
                if b.not_run is None and b.lang != "python" and not _is_output_of_run_block(found, i)]
    assert not unmarked, f"{_page_id(page)}: blocks at lines {unmarked} neither run nor say why"
    assert sum(b.not_run is not None for b in found) == NOT_RUN[_page_id(page)]


def _is_output_of_run_block(found: list[Block], index: int) -> bool:
    """Whether block `index` is the output shown right after a python block that runs."""
    if not 0 < index < len(found):
        return False
    before, block = found[index - 1], found[index]
    return block.adjacent and block.lang in ("", "text") and before.lang == "python" and before.not_run is None


@pytest.mark.parametrize("page", PAGES, ids=_page_id)
def test_examples_run_and_print_what_they_show(page: Path, tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    found = blocks(page)
    runnable = [(i, b) for i, b in enumerate(found) if b.lang == "python" and b.not_run is None]
    if not runnable:
        return
    pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    threads = torch.get_num_threads()  # an example may set it for its CPU devices; the suite keeps its own
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("STAGEWISE_CACHE", str(tmp_path / "cache"))
    namespace: dict[str, object] = {"__name__": "__doc_example__"}
    for index, block in runnable:
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            code = compile("\n" * block.line + block.body, os.fspath(page), "exec")
            try:
                exec(code, namespace)  # noqa: S102 - the docs' own example
            finally:
                torch.set_num_threads(threads)
        if _is_output_of_run_block(found, index + 1):
            shown = found[index + 1].body
            assert output_matches(shown, printed.getvalue()), (
                f"{_page_id(page)} line {block.line}: shows\n{shown}\nbut prints\n{printed.getvalue()}")
