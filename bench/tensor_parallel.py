"""T = 2 against P = 2 on two gloo ranks of one host (issue 26's second figure), beside eager.

    python bench/tensor_parallel.py            # default run (about a minute on 2 CPU cores)
    python bench/tensor_parallel.py --quick    # smoke run (fewer steps)

A Hugging Face GPT-2 from a small config (4 blocks, d=256, 8 heads, vocab 1024, sequences of 64,
batches of 8, dropout off) is compiled by both of 2 spawned gloo ranks (file store, one intra-op
thread each) two ways, analytic costs so that both ranks plan alike, 2 microbatches, SGD:

- tensor parallel: `tensor_parallel=2` on one device: every block's attention and MLP split over
  the two ranks (Megatron's pairs), two all-reduces per block forward and two backward;
- pipeline: 2 devices, one stage per rank cut in the middle (`split_points=["transformer.h.2"]`),
  1F1B, activations sent between the ranks.

Each is timed over `--steps` steps after one warm-up, both ranks starting each step at a barrier;
the median step is printed per rank with the stage's parameter bytes on that rank and the
memory pool's peak (the runtime's ledger: parameters, gradients, stashes, messages). Eager
training of the same model in one process (rank 0, while rank 1 waits) is the baseline. The
ranks share this machine's cores with whatever else runs: the load is printed first.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import statistics
import tempfile
import time
from pathlib import Path

import _common
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

RANKS = 2
SGD = functools.partial(torch.optim.SGD, lr=0.01)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--quick", action="store_true", help="3 steps")
    parser.add_argument("--no-pin", action="store_true", help="leave OMP/MKL threads as they are")
    return parser.parse_args()


def make_model() -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel  # noqa: PLC0415 - only the ranks build it

    torch.manual_seed(0)
    config = GPT2Config(n_layer=4, n_embd=256, n_head=8, vocab_size=1024, n_positions=64, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config)


def batch() -> dict[str, torch.Tensor]:
    ids = torch.randint(1, 1024, (8, 64), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "labels": ids.clone()}


def timed_steps(step, steps: int) -> float:
    """The median seconds of `steps` calls after one warm-up, each started at a barrier."""
    step()
    seconds = []
    for _ in range(steps):
        dist.barrier()
        start = time.perf_counter()
        step()
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


def run_rank(rank: int, init_file: str, steps: int) -> None:
    import stagewise as sw  # noqa: PLC0415 - imported in the spawned rank

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=RANKS,
                            timeout=datetime.timedelta(seconds=300))
    torch.set_num_threads(1)
    inputs, rows = batch(), []
    ways = {"tensor parallel T=2": dict(devices=["cpu"], tensor_parallel=2),
            "pipeline P=2 (1F1B)": dict(devices=["cpu", "cpu"], split_points=["transformer.h.2"], schedule="1f1b")}
    for name, how in ways.items():
        devices = how.pop("devices")
        pipe = sw.compile(make_model(), devices, inputs, microbatches=2, cost="analytic", optimizer=SGD, **how)
        step_s = timed_steps(lambda p=pipe: p.step(**inputs), steps)
        params = sum(p.numel() * p.element_size() for w in pipe._workers for p in w.module.parameters())
        peak = max(row["peak_bytes"] or 0 for row in pipe.stats)
        rows.append((name, rank, step_s, params, peak))
        del pipe
    if rank == 0:
        model = make_model()
        optimizer = SGD(model.parameters())

        def eager_step() -> None:
            optimizer.zero_grad()
            model(**inputs).loss.backward()
            optimizer.step()

        start = time.perf_counter()
        for _ in range(steps + 1):
            eager_step()
        eager_s = (time.perf_counter() - start) / (steps + 1)
        rows.append(("eager, one process", 0, eager_s, sum(p.numel() * 4 for p in model.parameters()), None))
    parts: list = [None] * RANKS
    dist.all_gather_object(parts, rows)
    if rank == 0:
        print(f"{'':22} {'rank':>4} {'step ms':>9} {'params on rank':>15} {'pool peak':>10}")
        for name, r, seconds, params, peak in sorted((row for part in parts for row in part), key=lambda x: x[0]):
            pool = "(no pool)" if peak is None else f"{peak / 2**20:.2f} MiB"
            print(f"{name:22} {r:>4} {seconds * 1e3:9.1f} {params / 2**20:12.2f} MiB {pool:>10}")
    dist.destroy_process_group()


def main() -> None:
    args = parse_args()
    if not args.no_pin:
        _common.pin_threads()
    print(f"command: {_common.command_line()}")
    print(_common.machine_note())
    steps = 3 if args.quick else args.steps
    with tempfile.TemporaryDirectory() as root:
        mp.start_processes(run_rank, args=(str(Path(root) / "store"), steps), nprocs=RANKS, start_method="spawn")


if __name__ == "__main__":
    main()
