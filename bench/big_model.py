"""A model whose training footprint is several times the devices' memory: Harmony vs per-device swapping.

    python bench/big_model.py           # default run (about 2 minutes on 2 CPU cores)
    python bench/big_model.py --quick   # smoke run (about 30 s)

A GPT-style stack (untied head, so no weight is shared across packs and every pack updates
right after its last backward, Harmony's Table 3 regime) is trained on two logical CPU devices,
`sw.Device("cpu", memory=C)`, where C is chosen so that the training footprint

    weights + gradients + AdamW state (2 x weights) + activations of one minibatch

is `--ratio` (default 4) times the sum of the two capacities. The activation term is measured,
not estimated: one eager forward of the whole minibatch with `saved_tensors_hooks`, counting the
distinct storages autograd keeps (parameters excluded) plus the output.

Four pipelines train the same model on the same batches, in one run:

- harmony-pp, swap="auto"        (compile must decide to swap: the state does not fit)
- harmony-pp, swap="per-device"  (the per-GPU virtual-memory baseline: state in/out around every task)
- harmony-dp, swap="auto"
- harmony-dp, swap="per-device"

For each: samples/s (median step time after one warm-up step), swap volume per iteration from
`pipe.stats` deltas over the steady-state steps (weights, and all kinds: weights + gradients +
optimizer state), the per-device / Harmony ratio of those volumes for the same schedule, and each
device's peak pool bytes against its capacity.

Limit of this version of stagewise: stashed activations are not swapped. Under Harmony's grouped
schedule a device holds the stash of all its packs for all microbatches at the forward/backward
turn-around, so the activations (about half of the minibatch's, per device) must fit beside one
pack's state. The defaults therefore use short sequences of a wide model: 12 blocks, d=384,
16 sequences of 4 tokens in 16 microbatches (activations about a fifth of the weights), and as
many blocks as the planner makes packs, so that no pack holds two blocks (with `--layers 16` it
makes 16 packs for 16 blocks + embeddings, one of them two blocks whose state alone is 93% of a
device, and the second step fails). If the requested ratio does not fit, the script lowers it
step by step and says so.

On CPU the "device" and the "host" are the same memory, but swaps still copy (a swap-in makes a
device tensor of its own, a swap-out writes the host copy), so the throughput figures show the
memory-copy and bookkeeping cost of the two policies, not PCIe traffic. The swap volumes are what a
GPU would move.
"""

from __future__ import annotations

import argparse
import functools
import shlex
import statistics
import sys
import time

import _common
import torch
import torch.nn as nn
import torch.nn.functional as F

import stagewise as sw
from stagewise.ir.errors import StagewiseError


# ---- the model ---------------------------------------------------------------------------------------
def GPT(vocab: int, dim: int, heads: int, layers: int, context: int) -> nn.Module:  # noqa: N802 - reads as a class
    """The test zoo's GPT (tests/models/gpt.py) with an untied head: nothing is shared across the cut."""
    return _common.tests_models().TinyGPT(vocab=vocab, dim=dim, heads=heads, layers=layers, context=context, tie=False)


def lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


# ---- options -------------------------------------------------------------------------------------------
def add_model_arguments(p: argparse.ArgumentParser, microbatches: int) -> None:
    """The model's shape and its training batch (bench/checkpoint_io.py uses the same model)."""
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--dim", type=int, default=384)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--seq", type=int, default=4, help="tokens per sequence (short: activations must fit)")
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--batch", type=int, default=16, help="sequences per minibatch")
    p.add_argument("--microbatches", type=int, default=microbatches)
    p.add_argument("--lr", type=float, default=1e-3)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="smoke run: a smaller model, fewer steps (~30 s)")
    p.add_argument("--ratio", type=float, default=4.0, help="training footprint / sum of device capacities")
    p.add_argument("--devices", type=int, default=2)
    add_model_arguments(p, microbatches=16)
    p.add_argument("--steps", type=int, default=3, help="steady-state steps measured after one warm-up step")
    p.add_argument("--schedules", default="harmony-pp,harmony-dp")
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    args = p.parse_args(argv)
    if args.quick:
        args.dim, args.heads, args.batch, args.microbatches, args.steps = 256, 4, 8, 8, 1
    args.schedules = [s.strip() for s in args.schedules.split(",") if s.strip()]
    return args


def optimizer(args):
    return functools.partial(torch.optim.AdamW, lr=args.lr)


def make_model(args) -> nn.Module:
    torch.manual_seed(0)
    return GPT(args.vocab, args.dim, args.heads, args.layers, args.seq)


def make_batches(args, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    perm = torch.randperm(args.vocab, generator=g)  # a bigram chain: learnable, so the loss falls
    out = []
    for _ in range(n):
        ids = torch.empty(args.batch, args.seq + 1, dtype=torch.long)
        ids[:, 0] = torch.randint(0, args.vocab, (args.batch,), generator=g)
        for t in range(args.seq):
            ids[:, t + 1] = perm[ids[:, t]]
        out.append((ids[:, :-1].contiguous(), ids[:, 1:].contiguous()))
    return out


# ---- the footprint ---------------------------------------------------------------------------------------
def footprint(model: nn.Module, ids: torch.Tensor, target: torch.Tensor) -> dict[str, int]:
    """Bytes of weights, gradients, AdamW state and the activations autograd keeps for one minibatch."""
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    resident = {t.untyped_storage().data_ptr() for t in list(model.parameters()) + list(model.buffers())}
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        loss = lm_loss(model(ids), target)
    seen, activations = set(), 0
    for t in saved + [loss]:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in resident and ptr not in seen:
            seen.add(ptr)
            activations += t.untyped_storage().nbytes()
    return {"weights": weights, "grads": weights, "optimizer": 2 * weights, "activations": activations}


def fmt(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"


# ---- one configuration -------------------------------------------------------------------------------------
def run_config(args, schedule: str, swap: str, capacity: int, batches) -> dict:
    model = make_model(args)
    devices = [sw.Device("cpu", memory=capacity) for _ in range(args.devices)]
    ids, target = batches[0]
    pipe = sw.compile(model, devices, (ids,), loss_fn=lm_loss, example_target=target, schedule=schedule,
                      swap=swap, microbatches=args.microbatches,
                      optimizer=optimizer(args))
    losses, times, snapshots = [], [], []
    for ids, target in batches:
        start = time.perf_counter()
        losses.append(float(pipe.step(ids, target=target)))
        times.append(time.perf_counter() - start)
        snapshots.append(pipe.stats)
    steady = len(batches) - 1  # iterations between the first snapshot (after warm-up) and the last

    def per_iteration(key: str) -> float:
        return sum(last[key] - first[key] for first, last in zip(snapshots[0], snapshots[-1], strict=True)) / steady

    kinds = ("swap_weights_bytes", "swap_grads_bytes", "swap_optimizer_bytes")
    stages_per_device = [sum(s.device == d for s in pipe.plan.stages) for d in range(args.devices)]
    return {
        "schedule": schedule,
        "swap": swap,
        "swapped_stages": sum(w.swapped for w in pipe._workers),
        "stages": len(pipe.plan.stages),
        "packs": len({s.position for s in pipe.plan.stages}),
        "stages_per_device": stages_per_device,
        "step_s": statistics.median(times[1:]),
        "losses": losses,
        "weights": per_iteration("swap_weights_bytes"),
        "total": sum(per_iteration(k) for k in kinds),
        "peaks": [s["peak_bytes"] for s in snapshots[-1]],
        "capacity": capacity,
    }


def main() -> None:
    from rich.console import Console

    args = parse_args()
    torch.set_num_threads(args.threads)
    console = Console(width=150)
    console.print(f"[bold]command:[/bold] {shlex.join(['python', *sys.argv])}")
    batches = make_batches(args, 1 + args.steps)
    model = make_model(args)
    ids, target = batches[0]
    fp = footprint(model, ids, target)
    total = sum(fp.values())
    console.print(
        f"model: nn.Module, {args.layers} blocks, d={args.dim}, {args.heads} heads, vocab {args.vocab}, untied head, "
        f"{fp['weights'] / 4 / 1e6:.1f} M fp32 parameters; minibatch {args.batch} sequences x {args.seq} tokens "
        f"in {args.microbatches} microbatches; AdamW; {args.devices} logical CPU devices; "
        f"{torch.get_num_threads()} intra-op threads"
    )
    console.print(
        "training footprint: " + " + ".join(f"{k} {fmt(v)}" for k, v in fp.items()) + f" = {fmt(total)}"
    )

    results, ratio = None, args.ratio
    while results is None:
        capacity = int(total / (ratio * args.devices))
        console.print(f"capacity per device {fmt(capacity)} (sum {fmt(capacity * args.devices)}): "
                      f"footprint / sum of capacities = {total / (capacity * args.devices):.2f}")
        results = []
        for schedule in args.schedules:
            for swap in ("auto", "per-device"):
                try:
                    results.append(run_config(args, schedule, swap, capacity, batches))
                except StagewiseError as error:
                    console.print(f"[yellow]{schedule} swap={swap} at ratio {ratio:.2f} does not fit: "
                                  f"{type(error).__name__}: {error}[/yellow]")
                    results = None
                    break
            if results is None:
                break
        if results is None:
            if ratio <= 1.0:
                raise SystemExit("even a footprint equal to the devices' capacity does not fit")
            ratio = max(1.0, ratio * 0.85)
            console.print(f"[yellow]the requested ratio {args.ratio} cannot be met with this model: a device must "
                          "hold its largest pack's state (weights + grads + AdamW) beside the stash of every "
                          f"microbatch of its packs (stashed activations are not swapped yet); retrying at "
                          f"{ratio:.2f}[/yellow]")
    if ratio < args.ratio:
        console.print(f"[yellow]largest ratio achieved: {total / (capacity * args.devices):.2f} "
                      f"(requested {args.ratio})[/yellow]")
    report(console, args, results, fp, eager_losses(args, batches))


def predicted_weights(r: dict, weights: int, args) -> float:
    """Harmony's Table 3 weight swap volume per iteration for this row."""
    n, m = args.devices, args.microbatches
    if r["schedule"] == "harmony-pp":
        return 3 * weights if r["swap"] == "auto" else (4 * m + 2) * weights
    return 3 * n * weights if r["swap"] == "auto" else (4 * (m // n) + 2) * n * weights


def report(console, args, results: list[dict], fp: dict[str, int], eager: list[float]) -> None:
    from rich.table import Table

    total = sum(fp.values())
    table = Table(title=f"{args.layers}-block GPT, footprint {fmt(total)} on {args.devices} devices of "
                        f"{fmt(results[0]['capacity'])}: Harmony vs per-device swapping (per steady-state iteration)")
    cols = ("schedule", "swap=", "swapping stages", "packs (per dev)", "step s", "samples/s",
            "weights swapped", "Table 3 weights", "all kinds swapped", "per-dev / harmony weights",
            "per-dev / harmony all", "peak / capacity per device")
    for col in cols:
        table.add_column(col, justify="left" if col in ("schedule", "swap=") else "right")
    harmony = {r["schedule"]: r for r in results if r["swap"] == "auto"}
    for r in results:
        base = harmony[r["schedule"]]
        per_dev = r["swap"] == "per-device" and base["weights"] and base["total"]
        table.add_row(
            r["schedule"], r["swap"], f"{r['swapped_stages']}/{r['stages']}",
            f"{r['packs']} ({'/'.join(map(str, r['stages_per_device']))})", f"{r['step_s']:.2f}",
            f"{args.batch / r['step_s']:.2f}", fmt(r["weights"]), fmt(predicted_weights(r, fp["weights"], args)),
            fmt(r["total"]), f"{r['weights'] / base['weights']:.1f}x" if per_dev else "",
            f"{r['total'] / base['total']:.1f}x" if per_dev else "",
            " ".join(f"{p / r['capacity']:.0%}" for p in r["peaks"]),
        )
    console.print(table)
    console.print(f"capacity per device {fmt(results[0]['capacity'])} ({results[0]['capacity']} B); peak pool bytes: "
                  + "; ".join(f"{r['schedule']} {r['swap']}: " + ", ".join(fmt(p) for p in r["peaks"]) for r in results))
    console.print(
        f"Swap volumes are bytes moved in + out, summed over devices, averaged over {args.steps} steady-state steps "
        "(pipe.stats deltas after one warm-up step). Table 3 (Harmony): PP 3|W|, DP 3N|W|, per-GPU swapping "
        "(4m + 2)|W| (PP) and (4m + 2)N|W| (DP) with m microbatches per device; Harmony's measured weights are a "
        "little below 3|W| because a device's last pack runs forward and backward back to back and stays resident. "
        "'all kinds' = weights + gradients + AdamW state. Every peak is within its device's capacity (the pool "
        "raises CapacityError otherwise). On CPU device and host share memory, but swaps still copy, so step times "
        "show each policy's copy and bookkeeping cost, not link transfer time."
    )
    rows = [("eager (1 device, no capacity)", eager)] + [(f"{r['schedule']} swap={r['swap']}", r["losses"]) for r in results]
    worst = max(abs(a - b) for _, losses in rows[1:] for a, b in zip(losses, eager, strict=True))
    console.print("losses per step: " + "; ".join(f"{name}: {' '.join(f'{v:.6f}' for v in losses)}"
                                                 for name, losses in rows[:2]))
    console.print(f"max |loss - eager loss| over every configuration and step: {worst:.2e}")


def eager_losses(args, batches) -> list[float]:
    """The same training eagerly on one device (gradient accumulation over the same microbatches)."""
    model = make_model(args)
    opt = optimizer(args)(model.parameters())
    losses = []
    for ids, target in batches:
        total = 0.0
        for x, y in zip(ids.chunk(args.microbatches), target.chunk(args.microbatches), strict=True):
            loss = lm_loss(model(x), y) / args.microbatches
            loss.backward()
            total += float(loss.detach())
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses


if __name__ == "__main__":
    main()
