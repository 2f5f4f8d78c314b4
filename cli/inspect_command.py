"""`stagewise inspect CKPT`: what a saved pipeline holds and would run, as text: its plan
(plan.json, printed as `print(pipe.plan)` prints it), its programs (programs.txt) and each stage's
code: the code torch.fx generates for the stage rebuilt from stage_<i>.json, which is what
`sw.load` runs (the saved stage_<i>.py is for reading only and load never runs it).

The checkpoint is read and checked exactly as `sw.load` reads and checks it (compiler/
checkpoint_read.py, compiler/checkpoint/verify.py): every file against the marker, every name
its data calls against the allowlist, without materializing weights. What load would refuse,
inspect refuses with the same error (exit status 2), so a crafted checkpoint is never shown as
clean code. A checkpoint calling functions of the user's own is shown once they are named with
`--trusted module:function` (imported, as `sw.load(..., trusted_functions=[...])` would be given them).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from stagewise.cli.models import named_function
from stagewise.compiler.checkpoint.files import read_checked, read_marker
from stagewise.compiler.checkpoint.read import read_checkpoint, trusted_by_name
from stagewise.compiler.checkpoint.verify import rebuild_checkpoint
from stagewise.ir.errors import CheckpointError, UntrustedCodeError

PARTS = ("plan", "programs", "code")


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser], common: argparse.ArgumentParser) -> None:
    parser = commands.add_parser("inspect", parents=[common], help="show a saved checkpoint's plan, programs and code",
                                 description="Show what pipe.save wrote: the plan, the programs and the code sw.load "
                                             "would run, each file and every name checked as sw.load checks them; "
                                             "nothing is run.")
    parser.add_argument("checkpoint", type=Path, metavar="CKPT", help="the folder pipe.save(CKPT) wrote")
    parser.add_argument("--show", choices=PARTS, action="append",
                        help="only this part (repeatable; default: all three)")
    parser.add_argument("--trusted", action="append", default=[], metavar="MODULE:FUNCTION",
                        help="a function or class of yours the checkpoint calls (a loss function, an optimizer "
                             "class), as sw.load's trusted_functions; its module is imported (repeatable)")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    root: Path = args.checkpoint
    if not root.exists():
        raise CheckpointError(f"{root} does not exist; give the folder pipe.save() wrote")
    trusted = [named_function(spec, "--trusted") for spec in args.trusted]
    saved = read_checkpoint(root, None)
    try:
        rebuilt = rebuild_checkpoint(saved, trusted_by_name(trusted))
    except UntrustedCodeError as error:
        raise UntrustedCodeError(f"{error}; to inspect it, name each function of yours it calls: stagewise inspect "
                                 f"{root} --trusted module:function") from None
    shown = args.show or PARTS
    if "plan" in shown:
        _section(f"plan ({saved.root / 'plan.json'})", str(saved.plan))
    if "programs" in shown:
        _section(f"programs ({saved.root / 'programs.txt'})", _programs(saved.root))
    if "code" in shown:
        for stage, module in zip(saved.plan.stages, rebuilt.stages, strict=True):
            where = f"device {stage.device}: {saved.plan.devices[stage.device].name}"
            _section(f"stage {stage.index} on {where} (rebuilt from {saved.root / f'stage_{stage.index}.json'})",
                     module.code)
    return 0


def _programs(root: Path) -> str:
    """programs.txt (read_checkpoint checked it but keeps no text of it), checked again as it is read."""
    return read_checked(root, "programs.txt", read_marker(root)).decode()


def _section(title: str, body: str) -> None:
    print(f"== {title} ==")
    print(body.rstrip())
    print()
