"""`stagewise recommend MODEL`: which devices to rent for it (`sw.recommend`): every candidate device
set planned and simulated, ranked by cost or time under a deadline and a budget, with a bar over the
candidates while the search runs. Exits 1 when no candidate meets every constraint."""

from __future__ import annotations

import argparse

import stagewise as sw
from stagewise.cli.arguments import (
    add_model_arguments,
    add_training_arguments,
    duration,
    listed,
    optimizer_factory,
    positive_float,
    positive_int,
)
from stagewise.cli.models import load_workload
from stagewise.cli.progress import progress
from stagewise.compiler.advice.recommend import OBJECTIVES

NONE_MEETS = 1  # the exit status when no candidate meets every constraint (errors exit 2)


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser], common: argparse.ArgumentParser) -> None:
    parser = commands.add_parser("recommend", parents=[common], help="rank device sets to train a model on",
                                 description="Plan the model on every candidate device set and rank them by the "
                                             "run's cost or time, under a deadline and a budget.")
    add_model_arguments(parser)
    parser.add_argument("--candidates", action="append", metavar="REQUEST",
                        help="device sets to weigh ('8xH100', '2xp4d.24xlarge', a mix '1xp4d.24xlarge+2xg6.xlarge'; "
                             "repeat or comma-separate); default: "
                             "every priced instance type of the catalogue, 1, 2, 4, ... of them up to --max-devices")
    parser.add_argument("--objective", choices=OBJECTIVES, default="cost",
                        help="rank by the run's price (cost, default) or by iteration time (time)")
    parser.add_argument("--steps", type=positive_int, default=1, help="training steps of the run (default 1)")
    parser.add_argument("--deadline", type=duration, metavar="DURATION",
                        help="the run must end within this: seconds, or 90min, 36h, 2d")
    parser.add_argument("--budget", type=positive_float, metavar="USD", help="the run must cost at most this")
    parser.add_argument("--max-devices", type=positive_int, default=8, metavar="N",
                        help="the largest default candidate (default 8)")
    add_training_arguments(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """The search; a candidate it cannot plan (an unknown name, a missing figure) is a row saying why."""
    catalogue = sw.load_catalogue(args.catalogue)
    candidates = listed(args.candidates) or None
    workload = load_workload(args.model, args.batch, args.seq_len)
    with progress(f"planning {workload.name}") as report:
        recommendation = sw.recommend(workload.model, workload.example_inputs, catalogue=catalogue,
                                      candidates=candidates, objective=args.objective, deadline_s=args.deadline,
                                      budget_usd=args.budget, steps=args.steps, max_devices=args.max_devices,
                                      precision=args.precision, optimizer=optimizer_factory(args.optimizer, args.lr),
                                      loss_fn=workload.loss_fn, example_target=workload.example_target,
                                      progress=report)
    print(str(recommendation).rstrip("\n"))
    return 0 if recommendation.best is not None else NONE_MEETS
