"""Issue 23's memory-bound job: a GPT too big for a capped GPU, stagewise with swapping against FSDP2 with CPU offload.

    python bench/memory_bound.py                     # on cuda:0: 24 x 2048 GPT-2 (1.3 B), about 150 s
    python bench/memory_bound.py --layers 12 --cap-gib 8 --steps 2   # shrunk
    python bench/memory_bound.py --device cpu --layers 2 --dim 64 --heads 4 --vocab 512 --seq 32 --batch 4
                                                     # every code path on the CPU, at toy size

The model: Hugging Face GPT2LMHeadModel from a config, random weights, --layers x --dim (default 24 x
2048, 16 heads, vocabulary 32000, tied head: 1.27 B parameters), dropout off, batch --batch x --seq
tokens (default 8 x 1024) of random ids, AdamW (lr 1e-4), bf16 compute with fp32 weights.

Rows, in one run (each timed over --steps steps after one warm-up step, the median):

1. the cap: `torch.cuda.set_per_process_memory_fraction` to --cap-gib, which must be below eager's
   need (default: 3/4 of the training state, weights + gradients + AdamW's two moments at 16 B per
   parameter, 14.3 GiB for the default model, so that the state itself must be swapped). Every
   allocation of this process is capped until the eager row.
2. FSDP2: `fully_shard` on each block and the root, `CPUOffloadPolicy()`, `MixedPrecisionPolicy(bf16
   params, fp32 reduce)`, world size 1 (NCCL over a file store), AdamW over the host shards. FSDP2
   keeps a whole batch's activations as eager does: where they would take more than half the cap it
   recomputes them per block (Hugging Face's gradient checkpointing; --fsdp-checkpointing on / off
   decides instead), and the row says so.
3. stagewise on `sw.Device("cuda:0", memory=cap - headroom)` with the catalogue's figures for this
   GPU (H100 / H200; analytic costs need its FLOP/s and PCIe rate), swap="auto", precision="bf16":
   the planner chooses how to swap state and stashes through host memory. The headroom
   (--headroom-gib) is what stagewise's pool does not count (cuBLAS workspaces, the allocator's
   rounding). --optimizer-on-host adds a row with `optimizer_on_host=True` (ZeRO-Offload's split).
   It runs after FSDP2: torch keeps freed pinned host memory cached, and stagewise pins more.
4. eager, uncapped, last (--no-eager skips it): autocast bf16, the whole batch at once. Its measured
   peak (torch.cuda.max_memory_allocated) is eager training's need; beside it the activations autograd
   keeps, counted. Last, because on the H200 the memory eager left allocated failed the capped rows
   run after it.

Per row: tokens/s, step ms, peak GPU memory, last loss; then per system what bounds it: stagewise's
measured split (`pipe.time_breakdown()`), its host<->device bytes (`pipe.stats`) and the plan's
predicted split and bound (`Plan.predicted_split`); FSDP2's forward + backward against its host
AdamW step, measured, and its PCIe bytes (derived). `--json PATH` writes the figures.

On the CPU (`--device cpu`) nothing is capped (no allocator fraction): stagewise's device gets the
capacity, FSDP2 runs over gloo with `CPUOffloadPolicy(pin_memory=False)` (pinning needs a GPU), and
the figures only show that every path runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from math import nan
from pathlib import Path

import _common
import _memory_bound_systems as systems
import torch
from _memory_bound_systems import GiB, Row
from transformers.utils import logging as hf_logging

START = time.perf_counter()


def phase(text: str) -> None:
    """A timestamped line: the whole run must fit the GPU machine's few minutes."""
    print(f"[{time.perf_counter() - START:6.1f} s] {text}", flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda:0", help="cuda:0, or cpu to run every path at toy size")
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--dim", type=int, default=2048)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--batch", type=int, default=8, help="sequences per step")
    p.add_argument("--seq", type=int, default=1024, help="tokens per sequence")
    p.add_argument("--steps", type=int, default=3, help="timed steps per system, after one warm-up step")
    p.add_argument("--cap-gib", type=float, default=None, help="the GPU memory cap; default 3/4 of the training state")
    p.add_argument("--headroom-gib", type=float, default=2.0,
                   help="stagewise's device capacity is the cap less this (what its pool does not count)")
    p.add_argument("--no-eager", action="store_true", help="skip the uncapped eager row (its need is then counted)")
    p.add_argument("--optimizer-on-host", action="store_true", help="add a stagewise row with optimizer_on_host=True")
    p.add_argument("--fsdp-checkpointing", choices=("auto", "on", "off"), default="auto",
                   help="FSDP2 recomputes activations per block; auto: where a batch's exceed half the cap")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--json", type=Path, default=None, help="write the figures here")
    return p.parse_args(argv)


def model_on(args: argparse.Namespace, device: str):
    return systems.gpt(args.layers, args.dim, args.heads, args.vocab, args.seq, device)


def guarded(row: Row, run: Callable[[Row], None]) -> Row:
    """`run` fills `row`; an error (out of memory, no plan fits) is recorded in it, the traceback
    printed, and the bench goes on to the next system."""
    try:
        run(row)
    except (torch.OutOfMemoryError, RuntimeError, ValueError, sw_error()) as error:
        traceback.print_exc()
        row.error = f"{type(error).__name__}: {str(error).splitlines()[0][:300] if str(error) else ''}"
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return row


def sw_error() -> type[Exception]:
    from stagewise.ir.errors import StagewiseError  # noqa: PLC0415 - the bench's one use of the error tree

    return StagewiseError


def eager_row(args: argparse.Namespace, data, need: dict[str, float]) -> Row:
    """Eager, uncapped; fills `need` with the activations it keeps and its measured peak."""

    def run(row: Row) -> None:
        model = model_on(args, args.device)
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
        need["activations_gib"] = systems.activation_bytes(model, data[0], args.device) / GiB
        systems.measure(row, systems.eager_step(model, optimizer, args.device), data, 1, args.device)
        need["eager_peak_gib"] = row.peak_gib or float("nan")
        row.bound = "compute (uncapped: the whole training state on the device)"

    return guarded(Row("eager, uncapped"), run)


def stagewise_row(args: argparse.Namespace, data, cap: float, on_host: bool) -> Row:
    def run(row: Row) -> None:
        model = model_on(args, args.device).to("cpu")  # built on the GPU (fast), kept on the host
        catalogue_name = gpu_catalogue_name(args.device)
        target = systems.stagewise_device(args.device, int((cap - args.headroom_gib) * GiB), catalogue_name)
        phase(f"stagewise: compiling for {target}")
        pipe = systems.compile_stagewise(model, data[0], target, args.lr, on_host)
        del model
        phase(f"stagewise: compiled, {pipe.plan.schedule} x{pipe.plan.microbatches}; training")
        before: dict = {}
        step = systems.stagewise_step(pipe)

        def step_and_count(batch):
            before.clear()
            before.update(pipe.stats[0])
            return step(batch)

        systems.measure(row, step_and_count, data, 1, args.device)
        row.bound = systems.stagewise_bound(pipe, before, row)

    return guarded(Row("stagewise, swap=auto" + (", optimizer_on_host" if on_host else "")), run)


def fsdp2_checkpointing(args: argparse.Namespace, need: dict[str, float], cap: float) -> bool:
    """Whether FSDP2 recomputes activations: asked for, or (auto) where a whole batch's would take
    more than half the cap (or are unknown: no eager row counted them)."""
    if args.fsdp_checkpointing != "auto":
        return args.fsdp_checkpointing == "on"
    return need.get("activations_gib", float("inf")) > cap / 2


def fsdp2_row(args: argparse.Namespace, data, eager: Row | None, checkpointing: bool) -> Row:
    def run(row: Row) -> None:
        systems.world_of_one(args.device)
        try:
            model = systems.fsdp2(model_on(args, args.device), args.device, checkpointing)
            optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
            parameters = sum(p.numel() for p in model.parameters())
            split: dict[str, float] = {}
            systems.measure(row, systems.fsdp2_step(model, optimizer, args.device, split), data, 1, args.device)
            eager_s = eager.step_s if eager is not None and not eager.error else None
            row.bound = systems.fsdp2_bound(split, parameters, eager_s, row)
        finally:
            torch.distributed.destroy_process_group()

    return guarded(Row("FSDP2, CPUOffloadPolicy" + (", checkpointing" if checkpointing else "")), run)


def lift_cap(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.set_per_process_memory_fraction(1.0, torch.device(device))


def gpu_catalogue_name(device: str) -> str | None:
    """H100 or H200 (the catalogue's names) for this GPU, None on the CPU or another GPU (its
    figures are then assumed, and stagewise says so)."""
    if not device.startswith("cuda"):
        return None
    name = torch.cuda.get_device_name(torch.device(device))
    return next((known for known in ("H200", "H100") if known in name), None)


def choose_cap(args: argparse.Namespace, need_gib: float, state_gib: float) -> float:
    """--cap-gib, by default 3/4 of the training state: below eager's need, and low enough that the
    state itself must go through host memory (with half of eager's need, 32 GiB for the default
    model, stagewise's planner keeps the state on the device and recomputes activations instead)."""
    cap = args.cap_gib if args.cap_gib is not None else 0.75 * state_gib
    if cap >= need_gib:
        sys.exit(f"--cap-gib {cap:.1f} is not below eager's need of {need_gib:.1f} GiB: nothing would be memory-bound; "
                 "give a smaller cap")
    if cap <= args.headroom_gib:
        sys.exit(f"--cap-gib {cap:.1f} leaves stagewise nothing beyond --headroom-gib {args.headroom_gib}")
    if args.device.startswith("cuda"):
        total = torch.cuda.get_device_properties(torch.device(args.device)).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, cap * GiB / total), torch.device(args.device))
    return cap


def print_table(rows: list[Row]) -> None:
    print(f"\n{'system':<42} {'tokens/s':>10} {'step ms':>9} {'peak GiB':>9} {'last loss':>10}")
    for row in rows:
        if row.error:
            print(f"{row.system:<42} failed: {row.error}")
            continue
        peak = f"{row.peak_gib:.1f}" if row.peak_gib is not None else "-"
        print(f"{row.system:<42} {row.tokens_per_s:>10.0f} {row.step_s * 1e3:>9.1f} {peak:>9} {row.last_loss:>10.4f}")
    by_name = {row.system.split(",")[0]: row for row in rows if not row.error}
    if "stagewise" in by_name and "FSDP2" in by_name:
        ratio = by_name["stagewise"].tokens_per_s / by_name["FSDP2"].tokens_per_s
        print(f"stagewise / FSDP2 tokens/s: {ratio:.2f}x (issue 23's target: >= 1.3x)")
    print("\nwhat bounds each:")
    for row in rows:
        if row.bound:
            print(f"- {row.system}: {row.bound}")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    hf_logging.set_verbosity_error()
    phase(f"command: {_common.command_line()}")
    phase(f"device {args.device}" + (f" ({torch.cuda.get_device_name(torch.device(args.device))})"
                                     if args.device.startswith("cuda") else ""))
    data = systems.batches(1 + args.steps, args.batch, args.seq, args.vocab)
    parameters = sum(p.numel() for p in model_on(args, "meta").parameters())
    need: dict[str, float] = {"state_gib": 16 * parameters / GiB}
    phase(f"model: GPT-2 {args.layers} x {args.dim}, {args.heads} heads, vocabulary {args.vocab}, tied head, "
          f"{parameters / 1e9:.3f} B parameters; batch {args.batch} x {args.seq} tokens; AdamW; bf16 compute")
    counted = need["state_gib"]
    cap = choose_cap(args, counted, need["state_gib"])
    phase(f"cap: {cap:.3g} GiB" + (" (set_per_process_memory_fraction)" if args.device.startswith("cuda")
                                   else " (stagewise's device only: nothing caps the CPU)"))
    # FSDP2 before stagewise: torch keeps freed pinned host memory cached, and stagewise's (state,
    # stashes, undo copies) is the larger, so the host holds the smaller set beside the larger.
    rows = [fsdp2_row(args, data, None, fsdp2_checkpointing(args, need, cap))]
    phase("FSDP2: done")
    for on_host in (False, True) if args.optimizer_on_host else (False,):
        rows.append(stagewise_row(args, data, cap, on_host))
        phase(f"{rows[-1].system}: done")
    if not args.no_eager:  # last, uncapped: on the H200 what eager left allocated failed the capped rows after it
        lift_cap(args.device)
        rows.insert(0, eager_row(args, data, need))
        phase(f"eager's need: state {need['state_gib']:.3g} GiB + activations {need.get('activations_gib', nan):.3g}"
              f", measured peak {need.get('eager_peak_gib', nan):.3g} GiB (the cap was {cap:.3g} GiB)")
    print_table(rows)
    print(f"load average (1, 5, 15 min): {os.getloadavg()}")
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "need_gib": need,
                                         "cap_gib": cap, "rows": [dataclasses.asdict(r) for r in rows]}, indent=1))
        phase(f"figures written to {args.json}")


if __name__ == "__main__":
    main()
