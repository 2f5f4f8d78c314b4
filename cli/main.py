"""The `stagewise` command (and `python -m stagewise`): `plan`, `recommend`, `inspect`.

Every error a user can cause is one line on stderr and exit status 2: a `StagewiseError` names the
problem and the fix, so its traceback would only hide that line (`--debug` shows it instead);
argparse's usage errors get the same one-line form. A bug is still a traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import NoReturn

from stagewise.cli import inspect_command, plan_command, recommend_command
from stagewise.cli.errors import one_line
from stagewise.ir.errors import StagewiseError

PROG = "stagewise"
USAGE_ERROR = 2
INTERRUPTED = 130  # as a shell reports a command ended by Ctrl-C
EXAMPLES = f"""examples:
  {PROG} plan gpt2/config.json --devices 8xH100 --precision bf16 --trace plan.json
  {PROG} plan mymodels:build --devices 2xp4d.24xlarge --png plan.png
  {PROG} recommend gpt2/config.json --steps 10000 --deadline 36h --budget 500
  {PROG} inspect ckpt/"""


class _Parser(argparse.ArgumentParser):
    """argparse's usage errors as one line, like every other error of the command."""

    def error(self, message: str) -> NoReturn:
        self.exit(USAGE_ERROR, f"{self.prog}: error: {message}; see {self.prog} --help\n")


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--debug", action="store_true", help="show an error's traceback instead of its line")
    parser = _Parser(prog=PROG, description="Plan, size and inspect pipelines that train one PyTorch model "
                                            "across several devices.",
                     epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in (plan_command, recommend_command, inspect_command):
        command.add_parser(commands, common)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Runs one command; returns its exit status (0, or 1 where `recommend` finds no candidate)."""
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except StagewiseError as error:
        if args.debug:
            raise
        print(f"{PROG} {args.command}: error: {one_line(str(error)) or type(error).__name__}", file=sys.stderr)
        return USAGE_ERROR
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return INTERRUPTED
    except BrokenPipeError:  # `stagewise inspect ckpt | head`: the reader has all it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error flushing stdout at exit
        return 0
