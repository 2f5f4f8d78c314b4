"""`CommandLineError`: what only the command line can get wrong (a model spec, a file to write, a
value of a flag), a `StagewiseError` like every other, so it is printed as one line and exits 2;
and errors flattened to that one line."""

from stagewise.ir.errors import StagewiseError


class CommandLineError(StagewiseError):
    """A command-line argument that names nothing usable; the message names it and the fix."""


def one_line(text: str) -> str:
    """A message of several lines as one, nothing dropped."""
    return " ".join(line.strip() for line in text.strip().splitlines() if line.strip())


def first_line(error: BaseException) -> str:
    """Another library's error quoted inside ours: its kind and first line (the rest is --debug's)."""
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0]}" if text else type(error).__name__
