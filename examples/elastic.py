"""Training that survives a lost machine: torchrun restarts it on the ranks that remain, and it
goes on from the latest checkpoint, re-planned for them.

    python examples/elastic.py --checkpoints ckpt                       # one process, one device
    export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1  # else a same-size restart cannot connect (pytorch/pytorch#135712)
    torchrun --standalone --nproc-per-node 2 --max-restarts 1 examples/elastic.py --checkpoints ckpt
    # on each of two machines (ckpt on a shared filesystem); any but HOST, which keeps the rendezvous, may go
    torchrun --nnodes 1:2 --nproc-per-node 1 --max-restarts 1 --rdzv-backend c10d \
        --rdzv-endpoint HOST:29400 --rdzv-id job1 examples/elastic.py --checkpoints ckpt

Each (re)start compiles for the ranks it was given (one CPU device per rank), resumes from the
newest checkpoint under `--checkpoints` (saved by any number of ranks) and trains to `--steps`,
saving every `--every` steps. The batches are a function of the step index, so a restarted run
sees the data the uninterrupted one saw. `--die-at S --die-rank R` makes rank R exit at step S
(once: a marker file stops the restarted run from dying again); with `--lose-machine` it takes
its torchrun agent with it (SIGKILL, as a power cut would: the agent neither restarts nor leaves
the rendezvous), so that machine is gone and the survivors go on alone.
"""

from __future__ import annotations

import argparse
import functools
import os
import signal
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

import stagewise as sw

FEATURES, CLASSES, BATCH = 16, 4, 16


def build_model(seed: int) -> nn.Sequential:
    """The same MLP on every rank and every restart (no dropout: runs compare exactly)."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(FEATURES, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(),
                         nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, CLASSES))


def batch(step: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step `step`'s minibatch, a function of the step alone (whoever runs it, whenever)."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + step)
    x = torch.randn(BATCH, FEATURES, generator=generator)
    teacher = torch.randn(FEATURES, CLASSES, generator=torch.Generator().manual_seed(seed))
    return x, (x @ teacher).argmax(dim=1)


def arguments(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoints", required=True, help="the folder of step_<n> checkpoints")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--every", type=int, default=2, help="save every this many steps")
    parser.add_argument("--keep", type=int, default=3, help="how many checkpoints to keep")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=30.0, help="seconds a rank waits for a silent peer")
    parser.add_argument("--final", help="write the trained state_dict here (rank 0)")
    parser.add_argument("--die-at", type=int, help="the step at which --die-rank exits (once)")
    parser.add_argument("--die-rank", type=int, help="the rank that dies (default: any this command starts)")
    parser.add_argument("--lose-machine", action="store_true",
                        help="the dying rank kills its torchrun agent first: the whole machine is lost")
    args = parser.parse_args(argv)
    if args.lose_machine and "TORCHELASTIC_RUN_ID" not in os.environ:
        parser.error("--lose-machine kills this process's torchrun agent: run under torchrun")
    return args


def maybe_die(args: argparse.Namespace, step: int, rank: int) -> None:
    """Simulate the failure once: a marker file says it happened, so the restarted run goes on."""
    if args.die_at != step or args.die_rank not in (None, rank):
        return
    marker = Path(args.checkpoints) / f".died-rank{rank}-step{step}"
    if marker.exists():
        return
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.touch()
    print(f"rank {rank} dies at step {step}", flush=True)
    if args.lose_machine:
        os.kill(os.getppid(), signal.SIGKILL)  # the agent: no restart here, no goodbye to the rendezvous
    os._exit(1)


def main(argv: list[str] | None = None) -> None:
    args = arguments(argv)
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    x, y = batch(0, args.seed)
    pipe = sw.compile(build_model(args.seed), world, (x,), loss_fn=F.cross_entropy, example_target=y,
                      optimizer=functools.partial(torch.optim.SGD, lr=0.05, momentum=0.9),
                      microbatches=4, schedule="gpipe", cost="analytic")
    pipe.timeout_s = args.timeout
    scheduler = torch.optim.lr_scheduler.LambdaLR(pipe.optimizer, lambda s: min(1.0, (s + 1) / 4))
    checkpoints = sw.Checkpoints(args.checkpoints, every_steps=args.every, keep=args.keep)
    start = checkpoints.resume(pipe, scheduler)
    if rank == 0:
        print(f"world {world}: starting at step {start}", flush=True)
    for step in range(start, args.steps):
        maybe_die(args, step, rank)
        inputs, target = batch(step, args.seed)
        loss = pipe.step(inputs, target=target)
        scheduler.step()
        checkpoints.after_step(pipe, scheduler)
        if rank == 0:
            print(f"step {step} loss {float(loss):.6f} world {world}", flush=True)
    state = pipe.state_dict()  # under torchrun every rank gathers every stage
    if rank == 0:
        checksum = sum(float(t.double().sum()) for t in state.values())
        print(f"final checksum {checksum:.9f}", flush=True)
        if args.final:
            torch.save(state, args.final)


if __name__ == "__main__":
    main()
