"""`stagewise inspect CKPT`: what a saved pipeline holds, as text: its plan (plan.json, printed as
`print(pipe.plan)` prints it), its programs (programs.txt) and each stage's code (stage_<i>.py).
Every file is checked against the checkpoint's marker, and nothing is unpickled or imported, so a
checkpoint from anywhere can be looked at without running its code."""

from __future__ import annotations

import argparse
from pathlib import Path

from stagewise.compiler.checkpoint_files import FileRecord, read_checked, read_marker
from stagewise.ir.errors import CheckpointError
from stagewise.ir.plan import Plan

PARTS = ("plan", "programs", "code")


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser], common: argparse.ArgumentParser) -> None:
    parser = commands.add_parser("inspect", parents=[common], help="show a saved checkpoint's plan, programs and code",
                                 description="Show what pipe.save wrote: the plan, the programs and the stage code, "
                                             "each file checked; nothing is unpickled or run.")
    parser.add_argument("checkpoint", type=Path, metavar="CKPT", help="the folder pipe.save(CKPT) wrote")
    parser.add_argument("--show", choices=PARTS, action="append",
                        help="only this part (repeatable; default: all three)")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    root: Path = args.checkpoint
    if not root.exists():
        raise CheckpointError(f"{root} does not exist; give the folder pipe.save() wrote")
    files = read_marker(root)
    plan = _plan(root, files)
    shown = args.show or PARTS
    if "plan" in shown:
        _section(f"plan ({root / 'plan.json'})", str(plan))
    if "programs" in shown:
        _section(f"programs ({root / 'programs.txt'})", _text(root, "programs.txt", files))
    if "code" in shown:
        for stage in plan.stages:
            name = f"stage_{stage.index}.py"
            where = f"device {stage.device}: {plan.devices[stage.device].name}"
            _section(f"stage {stage.index} on {where} ({root / name})", _text(root, name, files))
    return 0


def _plan(root: Path, files: dict[str, FileRecord]) -> Plan:
    try:
        return Plan.from_json(_text(root, "plan.json", files))
    except (ValueError, KeyError, TypeError) as error:
        raise CheckpointError(f"{root / 'plan.json'} is whole but cannot be read ({type(error).__name__}: {error}); "
                              "it was probably written by another version of stagewise: inspect it with that "
                              "version") from error


def _text(root: Path, name: str, files: dict[str, FileRecord]) -> str:
    return read_checked(root, name, files).decode()


def _section(title: str, body: str) -> None:
    print(f"== {title} ==")
    print(body.rstrip())
    print()
