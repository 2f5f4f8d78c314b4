"""`stagewise plan MODEL --devices 8xH100`: the plan `compile` would choose on devices this machine
need not have (`sw.plan`: the model on the meta device, every cost modelled from the catalogue's
figures), printed as its tables, and its predicted timeline written as a Chrome trace or a PNG."""

from __future__ import annotations

import argparse
from pathlib import Path

import stagewise as sw
from stagewise.cli.arguments import (
    add_model_arguments,
    add_training_arguments,
    listed,
    optimizer_factory,
    positive_int,
)
from stagewise.cli.devices import requested_devices
from stagewise.cli.errors import CommandLineError
from stagewise.cli.models import load_workload
from stagewise.cli.progress import progress
from stagewise.ir.choices import Schedule


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser], common: argparse.ArgumentParser) -> None:
    parser = commands.add_parser("plan", parents=[common], help="plan a model for devices you name",
                                 description="The plan stagewise.compile would choose on the devices named, "
                                             "predicted from their figures; nothing runs on them.")
    add_model_arguments(parser)
    parser.add_argument("--devices", action="append", required=True, metavar="REQUEST",
                        help="accelerators ('8xH100') or instance types ('p4d.24xlarge', '2xp4d.24xlarge') of the "
                             "catalogue; repeat, comma-separate or join with + to mix")
    add_training_arguments(parser)
    parser.add_argument("--schedule", choices=tuple(Schedule), default=Schedule.AUTO, help="default: the planner's choice")
    parser.add_argument("--asynchronous", action="store_true",
                        help="allow updates with stale gradients: needed by --schedule 2bw, and lets auto weigh it")
    parser.add_argument("--microbatches", type=positive_int, metavar="M", help="default: the planner's choice")
    parser.add_argument("--trace", type=Path, metavar="FILE.json",
                        help="write the predicted timeline as a Chrome trace (open in Perfetto)")
    parser.add_argument("--png", type=Path, metavar="FILE.png",
                        help="draw the predicted timeline (needs matplotlib: pip install 'stagewise[plot]')")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Devices and files first (a typo fails before the model is built), then the model, the plan, the files."""
    for path in (args.trace, args.png):
        if path is not None and not path.parent.is_dir():
            raise CommandLineError(f"cannot write {path}: there is no folder {path.parent}; create it first")
    catalogue = sw.load_catalogue(args.catalogue)
    devices = requested_devices(listed(args.devices), catalogue, args.precision)
    workload = load_workload(args.model, args.batch, args.seq_len)
    with progress(f"planning {workload.name} on {len(devices.devices)} devices", counted=False):
        plan = sw.plan(workload.model, list(devices.devices), workload.example_inputs, loss_fn=workload.loss_fn,
                       example_target=workload.example_target, optimizer=optimizer_factory(args.optimizer, args.lr),
                       microbatches=args.microbatches, schedule=args.schedule, precision=args.precision,
                       topology=devices.topology, asynchronous=args.asynchronous)
    print(devices.describe())
    print(plan)
    if args.trace is not None or args.png is not None:
        write_timeline(plan, args.trace, args.png)
    return 0


def write_timeline(plan: sw.Plan, trace: Path | None, png: Path | None) -> None:
    """The predicted iteration (`sw.simulate`) in the files asked for, each named once written."""
    timeline = sw.simulate(plan)
    for path, write, what in ((trace, timeline.to_chrome_trace, "Chrome trace: open it in Perfetto"),
                              (png, timeline.to_png, "Gantt chart")):
        if path is None:
            continue
        try:
            write(path)
        except OSError as error:
            raise CommandLineError(f"cannot write {path} ({error.strerror or error}); give a path you can write "
                                   "to") from error
        print(f"wrote {path} ({what})")
