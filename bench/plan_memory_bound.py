"""What `sw.plan` chooses for bench/memory_bound.py's job, without the GPU: the 1.27 B GPT-2 (24 x 2048)
on the meta device, planned for the capped H200 that bench describes (the catalogue's figures,
memory = cap - headroom: 13.17 GB by default), bf16, AdamW, swap="auto".

    python bench/plan_memory_bound.py                      # device optimizer and optimizer_on_host, ~2 min
    python bench/plan_memory_bound.py --layers 12 --cap-gib 8

Per row: the chosen plan, its predicted step (analytic costs), where the time goes, the predicted peak,
and the bytes its programs move over the host link per step (state swaps, stashes), beside FSDP2's step
measured on the H200 (--fsdp2-s, 2.19 s: forward + backward 0.40 s, host AdamW 1.79 s). The analytic
model charges compute at the catalogue's peak FLOP/s, so the compute part is low (the GPU run measured
0.87 s of compute where a plan with stashes kept predicted 0.1 s); `floor` is the PCIe-bound step the
plan cannot beat, its busier direction's bytes over --pcie-gbs (54 GB/s measured). Nothing is asserted.
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

import _memory_bound_systems as systems
import torch
from _memory_bound_systems import GiB
from transformers.utils import logging as hf_logging

import stagewise as sw
from stagewise.ir.instructions import Activity, StashIn, StashOut


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--dim", type=int, default=2048)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--cap-gib", type=float, default=None, help="default: 3/4 of the training state, as the bench")
    p.add_argument("--headroom-gib", type=float, default=2.0)
    p.add_argument("--fsdp2-s", type=float, default=2.1886, help="FSDP2's measured step (H200, the bench's default job)")
    p.add_argument("--pcie-gbs", type=float, default=54.0, help="host link GB/s measured by the bench's GPU run")
    return p.parse_args(argv)


def moved_gb(plan: sw.Plan) -> dict[str, float]:
    """GB per step over the host link: state in, state out, stashes (both ways)."""
    moved: dict[str, float] = defaultdict(float)
    for program in plan.programs:
        for ins in program.instructions:
            nbytes = getattr(ins, "nbytes", 0)
            if isinstance(ins, StashIn | StashOut):
                moved["stash"] += nbytes / 1e9
            elif ins.facts.activity is Activity.SWAP_IN:
                moved["in"] += nbytes / 1e9
            elif ins.facts.activity is Activity.SWAP_OUT:
                moved["out"] += nbytes / 1e9
    return moved


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    hf_logging.set_verbosity_error()
    model = systems.gpt(args.layers, args.dim, 16, 32000, args.seq, "meta")
    parameters = sum(p.numel() for p in model.parameters())
    cap = args.cap_gib if args.cap_gib is not None else 0.75 * 16 * parameters / GiB
    device = systems.stagewise_device("cuda:0", int((cap - args.headroom_gib) * GiB), "H200")
    ids = torch.zeros(args.batch, args.seq, dtype=torch.long)
    print(f"GPT-2 {args.layers} x {args.dim}, {parameters / 1e9:.3f} B parameters, batch {args.batch} x {args.seq}; "
          f"cap {cap:.1f} GiB, stagewise's device {device.memory / 1e9:.2f} GB, H200 figures, bf16, AdamW")
    for on_host in (False, True):
        start = time.perf_counter()
        plan = sw.plan(model, [device], {"input_ids": ids, "labels": ids}, optimizer=systems.adamw(1e-4),
                       precision="bf16", memory=sw.MemoryOptions(swap="auto", optimizer_on_host=on_host))
        moved = moved_gb(plan)
        floor = (max(moved["in"], moved["out"]) + moved["stash"] / 2) / args.pcie_gbs
        policies = sorted({str(s.activations) for s in plan.stages})
        print(f"\n{'optimizer on the host' if on_host else 'optimizer on the device'} (planned in "
              f"{time.perf_counter() - start:.0f} s): {plan.schedule} x{plan.microbatches}, {len(plan.stages)} packs, "
              f"activations {'/'.join(policies)}")
        print(f"  predicted {plan.predicted_iteration_s:.3f} s ({plan.predicted_split}); peak "
              f"{max(plan.predicted_peak_bytes) / GiB:.1f} GiB of {device.memory / GiB:.1f}")
        print(f"  host link per step: state in {moved['in']:.1f} GB, out {moved['out']:.1f} GB, stashes "
              f"{moved['stash']:.1f} GB; PCIe floor {floor:.2f} s at {args.pcie_gbs:.0f} GB/s; FSDP2 measured "
              f"{args.fsdp2_s:.2f} s")


if __name__ == "__main__":
    main()
