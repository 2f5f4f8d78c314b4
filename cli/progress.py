"""Progress on stderr while a search runs: a bar over the candidates `sw.recommend` reports, or a
spinner with the time spent for `sw.plan`. Shown only on a terminal, so that a log or a pipe gets
the result alone."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
)

Report = Callable[[int, int, str], None]  # (done, in all, what starts now): sw.recommend's `progress`


@contextmanager
def progress(what: str, counted: bool = True) -> Iterator[Report]:
    """A live line saying `what` runs and for how long; where `counted`, a bar the yielded `Report` moves."""
    console = Console(stderr=True)
    count = (BarColumn(), MofNCompleteColumn()) if counted else ()
    columns = (SpinnerColumn(), TextColumn("{task.description}"), *count, TimeElapsedColumn())
    with Progress(*columns, console=console, transient=True, disable=not console.is_terminal) as bar:
        task = bar.add_task(what, total=None)

        def report(done: int, total: int, label: str) -> None:
            bar.update(task, completed=done, total=total, description=f"{what}: {label}" if label else what)

        yield report
