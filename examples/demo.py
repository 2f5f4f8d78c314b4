"""Compile a Hugging Face GPT-2 (small config, random weights) onto 4 CPU devices and train it.

Prints the plan, the shared tensors, the first stage's generated code, the loss of each step
beside eager single-device training, and where the time went.
"""

from __future__ import annotations

import copy
import functools
import os
import time

import torch
from rich.console import Console
from rich.table import Table
from transformers import GPT2Config, GPT2LMHeadModel
from transformers.utils import logging as hf_logging

import stagewise as sw

STEPS, BATCH, LENGTH, DEVICES, MICROBATCHES = 5, 16, 32, 4, 4


def main() -> None:
    hf_logging.set_verbosity_error()
    # 4 devices in one process, each computing on its own thread: one intra-op thread each where the
    # cores are fewer (sw.compile warns otherwise; oversubscribed OpenMP teams made steps 1.4x slower)
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // DEVICES))
    torch.manual_seed(0)
    console = Console(width=max(140, Console().width))  # the plan table needs the room, even in a pipe
    config = GPT2Config(n_layer=6, n_embd=128, n_head=4, vocab_size=1024, n_positions=64,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config)
    eager = copy.deepcopy(model)
    optimizer = functools.partial(torch.optim.AdamW, lr=3e-4)
    batches = [torch.randint(0, config.vocab_size, (BATCH, LENGTH)) for _ in range(STEPS)]
    example = {"input_ids": batches[0], "labels": batches[0]}

    pipe = sw.compile(model, DEVICES, example, optimizer=optimizer, microbatches=MICROBATCHES, clip_grad_norm=1.0)
    # microbatches is fixed so the eager reference below uses the same split; the planner still
    # chooses the schedule and the partition (schedule="auto")
    show_generated(console, pipe)
    pipe_s, eager_s = train_beside_eager(console, pipe, eager, optimizer(eager.parameters()), batches)
    drift = max((pipe.state_dict()[k] - v).abs().max().item() for k, v in eager.state_dict().items())
    console.print(f"largest parameter difference after {STEPS} steps: {drift:.2e}")
    show_where_the_time_went(console, pipe, pipe_s, eager_s)


def show_generated(console: Console, pipe: sw.Pipeline) -> None:
    """The plan, the first stage's generated code and one device's program."""
    console.print(pipe.plan)
    console.rule("first stage: generated code (first 25 lines)")
    console.print("\n".join(pipe.stages[0].code.strip().splitlines()[:25]), markup=False, highlight=False)
    console.rule("device 1 program")
    console.print(str(pipe.programs[1]), markup=False, highlight=False)


def train_beside_eager(console: Console, pipe: sw.Pipeline, eager, eager_opt, batches) -> tuple[float, float]:
    """Each step on the pipeline and on the eager model (the same microbatches, summed), losses side by
    side; the seconds each took in all."""
    table = Table(title=f"training: {DEVICES} CPU devices, {MICROBATCHES} microbatches vs eager, one device")
    for column in ("step", "stagewise loss", "eager loss", "|difference|", "stagewise s", "eager s"):
        table.add_column(column, justify="right")
    pipe_s = eager_s = 0.0
    for step, ids in enumerate(batches):
        t0 = time.perf_counter()
        loss = pipe.step(input_ids=ids, labels=ids)
        t1 = time.perf_counter()
        eager_opt.zero_grad()
        reference = 0.0
        for chunk in ids.chunk(MICROBATCHES):
            part = eager(input_ids=chunk, labels=chunk).loss / MICROBATCHES
            part.backward()
            reference += part.detach()
        torch.nn.utils.clip_grad_norm_(eager.parameters(), 1.0)
        eager_opt.step()
        t2 = time.perf_counter()
        pipe_s, eager_s = pipe_s + t1 - t0, eager_s + t2 - t1
        table.add_row(str(step), f"{float(loss):.6f}", f"{float(reference):.6f}",
                      f"{abs(float(loss) - float(reference)):.2e}", f"{t1 - t0:.3f}", f"{t2 - t1:.3f}")
    console.print(table)
    return pipe_s, eager_s


def show_where_the_time_went(console: Console, pipe: sw.Pipeline, pipe_s: float, eager_s: float) -> None:
    """Compile phases, training time, and the last step per device (compute, waiting, the runtime's
    dispatch, swap, p2p) beside the simulator's prediction; then whether the model or the runtime dominates."""
    console.rule("where the time went")
    for phase, seconds in pipe.compile_times.items():
        console.print(f"compile: {phase:<45} {seconds:7.2f} s")
    console.print(f"training: stagewise {pipe_s:.2f} s, eager {eager_s:.2f} s for {STEPS} steps on this "
                  f"{os.cpu_count()}-core machine (the {DEVICES} logical devices share its cores)")
    simulated = pipe.simulate()
    breakdown = Table(title="last step, per device: ms (% of the step) on its compute thread, swap and p2p "
                            "beside it, and the simulator's prediction")
    for column in ("device", "compute", "waiting", "dispatch", "swap", "p2p", "measured step", "predicted busy",
                   "predicted step"):
        breakdown.add_column(column, justify="right")
    rows = pipe.time_breakdown()
    for row in rows:
        share = [f"{seconds * 1e3:.1f} ({100 * seconds / row.step_s:.0f}%)"
                 for seconds in (row.compute_s, row.waiting_s, row.dispatch_s, row.swap_s, row.p2p_s)]
        breakdown.add_row(str(row.device), *share, f"{row.step_s * 1e3:.1f}",
                          f"{simulated.busy.get(row.device, 0.0) * 1e3:.1f}", f"{simulated.iteration_time * 1e3:.1f}")
    console.print(breakdown)
    console.print(verdict(rows), soft_wrap=True)
    sent = sum(s["p2p_bytes"] for s in pipe.stats)
    peaks = ", ".join(f"{s['peak_bytes'] / 2**20:.1f} MiB" for s in pipe.stats)
    console.print(f"bytes sent between devices over {STEPS} steps: {sent / 2**20:.2f} MiB; peak memory per device: {peaks}")


def verdict(rows: list[sw.DeviceTime]) -> str:
    """One line: whether the model's compute or the runtime's dispatch took more of the devices' time."""
    total = sum(row.step_s for row in rows)
    compute = sum(row.compute_s for row in rows) / total
    dispatch = sum(row.dispatch_s for row in rows) / total
    waiting = sum(row.waiting_s for row in rows) / total
    who = "the model dominates" if compute >= dispatch else "the runtime dominates"
    return (f"{who}: compute {100 * compute:.0f}% of the devices' time, the runtime's dispatch "
            f"{100 * dispatch:.0f}%, waiting on other devices (the pipeline's bubble) {100 * waiting:.0f}%")


if __name__ == "__main__":
    main()
