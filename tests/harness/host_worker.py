"""One rank of a job on the two namespace hosts (tests/harness/two_hosts.py), run by torchrun as
`python -m tests.harness.host_worker`: it compiles a small MLP for the job's ranks, trains a few
steps and, on rank 0, saves what the test compares with eager training: the losses, the trained
parameters, where each stage instance ran (and on which host), the topology the planner measured
and what it predicted."""

from __future__ import annotations

import argparse
import functools
import os
import pickle
import socket
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import stagewise as sw

FEATURES, WIDTH, CLASSES, BATCH, MICROBATCHES = 16, 256, 4, 16, 4
SGD = functools.partial(torch.optim.SGD, lr=0.05, momentum=0.9)


def build_model(seed: int = 0, width: int = WIDTH) -> nn.Sequential:
    """Weights large next to the activations (256 KiB a layer, 4 KiB a microbatch's activation at
    the default width): what crosses the slow link decides the plan."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(FEATURES, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh(),
                         nn.Linear(width, width), nn.Tanh(), nn.Linear(width, CLASSES))


def batches(steps: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The same minibatches on every rank and in the eager reference."""
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randn(BATCH, FEATURES, generator=generator), torch.randint(0, CLASSES, (BATCH,), generator=generator))
            for _ in range(steps)]


def compile_for_job(replicas: int | str, stages: int | str | None, width: int = WIDTH,
                    cost: str = "analytic") -> sw.Pipeline:
    """The pipeline every rank of the job compiles (the same call on each)."""
    x, y = batches(1)[0]
    return sw.compile(build_model(width=width), int(os.environ["WORLD_SIZE"]), (x,), loss_fn=F.cross_entropy, example_target=y,
                      optimizer=SGD, microbatches=MICROBATCHES, schedule="1f1b", replicas=replicas, stages=stages,
                      cost=cost)


def placement(pipe: sw.Pipeline) -> list[tuple[int, int, str]]:
    """Each stage instance's logical stage, device (rank) and host name, in instance order (a collective)."""
    names: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(names, socket.gethostname())
    return [(s.position, s.device, str(names[s.device])) for s in sorted(pipe.plan.stages, key=lambda s: s.index)]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--replicas", default="1")
    parser.add_argument("--stages", default=None)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", required=True, help="rank 0 writes result.pkl here")
    args = parser.parse_args(argv)
    replicas = args.replicas if args.replicas == "auto" else int(args.replicas)
    stages = args.stages if args.stages in (None, "auto") else int(args.stages)
    pipe = compile_for_job(replicas, stages)
    losses = [float(pipe.step(x, target=y)) for x, y in batches(args.steps)]
    where, state = placement(pipe), pipe.state_dict()  # collectives: every rank
    if dist.get_rank() == 0:
        result = {"losses": losses, "state": state, "placement": where, "topology": pipe.plan.costs.topology,
                  "predicted_s": pipe.plan.predicted_iteration_s, "considered": pipe.plan.considered}
        Path(args.out, "result.pkl").write_bytes(pickle.dumps(result))
    leave()


def leave() -> None:
    """Leave the job once every rank is done: a process that exits with the group still up may
    abort in gloo's teardown (seen once here: 'terminate called without an active exception')."""
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
