"""The public API documents itself: every object of `stagewise.__all__` and the public methods of its
classes carry Google-style sections (Args, Returns, Raises, Example), and every `>>>` example runs here.

The examples share one namespace, built once: `sw`, `torch`, `nn`, `F`, a tiny MLP `model` compiled
onto 2 CPU devices as `pipe`, a minibatch `x` with targets `y`, `tmp`, an empty folder, and
`recommendation`, what `sw.recommend` makes of it on a g6.xlarge and a p4d.24xlarge. Each
docstring's examples run in a copy of it (names an example defines stay in its docstring), but `pipe`
is one object: an example that changes it (a step, a load) leaves the change for the next, so examples
print what holds whatever ran before them (shapes, types, names) rather than losses.
"""

from __future__ import annotations

import ast
import doctest
import enum
import inspect
import re
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import stagewise as sw
from tests.models.mlp import mlp

OPTIONS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE


def _public_objects() -> Iterator[tuple[str, object]]:
    """(dotted name, object) for every name of `stagewise.__all__` and every public method or property
    a class of it defines or inherits from stagewise's own classes (`Pipeline`'s from its bases)."""
    for name in sorted(sw.__all__):
        obj = getattr(sw, name)
        yield name, obj
        if not isinstance(obj, type) or issubclass(obj, (BaseException, enum.Enum)):
            continue
        seen: set[str] = set()
        for owner in obj.__mro__:
            if not owner.__module__.startswith("stagewise."):
                continue
            for member, value in vars(owner).items():
                if member.startswith("_") or member in seen:
                    continue
                seen.add(member)
                if isinstance(value, (property, classmethod, staticmethod)) or inspect.isfunction(value):
                    yield f"{name}.{member}", value


def _function(obj: object) -> Callable | None:
    """The plain function behind a function, method, classmethod or staticmethod; None for the rest."""
    if isinstance(obj, (classmethod, staticmethod)):
        obj = obj.__func__
    return inspect.unwrap(obj) if inspect.isfunction(obj) else None


def _raises(function: Callable) -> bool:
    """Whether the function's own body raises (a `raise` statement outside nested functions)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    body = tree.body[0]
    assert isinstance(body, ast.FunctionDef | ast.AsyncFunctionDef)
    return any(isinstance(node, ast.Raise) for node in ast.walk(body))


def _parameters(function: Callable) -> list[str]:
    names = list(inspect.signature(function).parameters)
    return names[1:] if names and names[0] in ("self", "cls") else names


def missing_sections(name: str, obj: object) -> list[str]:
    """The sections a public object's docstring lacks: every object a summary; an error or warning
    class who raises (or warns) it; a class its constructor's `Args:` and an `Example:`; a property
    an `Example:`; a function `Args:` (if it takes any), `Returns:` (unless it returns None),
    `Raises:` (a public function always: they check their arguments; a method if its body raises)
    and an `Example:`."""
    doc = inspect.getdoc(obj.fget if isinstance(obj, property) else obj) or ""
    if not doc.strip():
        return ["summary"]
    wanted: list[str] = []
    if isinstance(obj, type) and issubclass(obj, BaseException):
        return [] if re.search(r"\b(raised|warned|raises)\b", doc, re.IGNORECASE) else ["who raises it"]
    if isinstance(obj, type):
        if not issubclass(obj, enum.Enum) and _parameters(obj.__init__):
            wanted.append("Args:")
    elif (function := _function(obj)) is not None:
        if _parameters(function):
            wanted.append("Args:")
        if inspect.signature(function).return_annotation not in (None, "None"):
            wanted.append("Returns:")
        if "." not in name or _raises(function):
            wanted.append("Raises:")
    wanted.append("Example:")
    return [section for section in wanted if f"\n{section}" not in f"\n{doc}"]


def test_every_public_object_has_its_sections():
    missing = {name: gaps for name, obj in _public_objects() if (gaps := missing_sections(name, obj))}
    assert not missing, "public API docstrings lack sections:\n" + "\n".join(
        f"  {name}: {', '.join(gaps)}" for name, gaps in sorted(missing.items()))


def test_the_section_check_finds_gaps():
    def undocumented(a: int) -> int:
        """Only a summary."""
        if a < 0:
            raise ValueError(a)
        return a

    assert missing_sections("undocumented", undocumented) == ["Args:", "Returns:", "Raises:", "Example:"]
    assert missing_sections("Pipeline.undocumented", property(undocumented)) == ["Example:"]

    class SilentError(sw.StagewiseError):
        """The batch is wrong."""

    assert missing_sections("SilentError", SilentError) == ["who raises it"]


def _doctests() -> list[doctest.DocTest]:
    finder = doctest.DocTestFinder(recurse=False)
    found: dict[str, doctest.DocTest] = {}
    for name, obj in _public_objects():
        target = obj.fget if isinstance(obj, property) else _function(obj) or obj
        for test in finder.find(target, name, module=False, globs={}):
            if test.examples:
                found[name] = test
    return list(found.values())


DOCTESTS = _doctests()


@pytest.fixture(scope="module")
def namespace(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    torch.manual_seed(0)
    model = mlp()
    x, y = torch.randn(8, 8), torch.randint(0, 5, (8,))
    pipe = sw.compile(model, ["cpu", "cpu"], (x,), loss_fn=F.cross_entropy, example_target=y, microbatches=2)
    recommendation = sw.recommend(model, (x,), loss_fn=F.cross_entropy, example_target=y,
                                  candidates=["1xg6.xlarge", "1xp4d.24xlarge"], steps=1000)
    return {"sw": sw, "torch": torch, "nn": nn, "F": F, "model": model, "pipe": pipe, "x": x, "y": y,
            "tmp": tmp_path_factory.mktemp("doctests"), "recommendation": recommendation}


def test_every_example_section_holds_examples():
    """An `Example:` section of prose alone would pass the section check and run nothing."""
    with_examples = {test.name for test in DOCTESTS}
    bare = [name for name, obj in _public_objects()
            if not (isinstance(obj, type) and issubclass(obj, BaseException)) and name not in with_examples]
    assert not bare, f"public objects whose docstring runs no >>> example: {bare}"


@pytest.mark.parametrize("test", DOCTESTS, ids=[test.name for test in DOCTESTS])
def test_example_runs(test: doctest.DocTest, namespace: dict[str, object], monkeypatch: pytest.MonkeyPatch):
    monkeypatch.chdir(Path(str(namespace["tmp"])))
    test.globs = dict(namespace)
    runner = doctest.DocTestRunner(optionflags=OPTIONS)
    report: list[str] = []
    runner.run(test, out=report.append)
    assert runner.failures == 0, "".join(report)
