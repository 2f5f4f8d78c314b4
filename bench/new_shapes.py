"""New shapes: a step of a sequence length not seen before against a repeated one, eager beside.

    python bench/new_shapes.py                        # 12 rounds (~1 min on a quiet 2-core machine)
    python bench/new_shapes.py --rounds 20
    PYTHONPATH=/tmp/before python bench/new_shapes.py   # another checkout's stagewise (the line
                                                       # "stagewise imported from" names which one ran)

The model is issue 23's: a Hugging Face Llama of 4 layers, hidden 64 (random weights), fine-tuned
on 2 in-process CPU devices (batch 8, example length 64, 2 microbatches, SGD lr 0.01, the
compiler's default; cost="analytic"). Three ways of training run side by side: eager (the whole
batch), stagewise, and stagewise with `shape_buckets=16` (skipped where the checkout has no such
option). Each round steps once on the repeated length (60) and once on a length no configuration
has seen (58, 57, ...); the rounds alternate the configurations so drift in the machine's speed
affects all alike; medians are reported. The first step of the repeated length is reported
alone ("first new"): the first shape unlike the example pays the one-time work (the size class's
symbolic run; before it, a fake run of the stages as for every new shape). Target (issue 23): a new shape's step at most 1.5x a repeated shape's.

Timings on a shared 2-core machine are noisy: the header prints the load; compare runs made back
to back, and read the ratio columns rather than the milliseconds.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field, fields

import _common
import torch
from rich.table import Table
from transformers import LlamaConfig, LlamaForCausalLM

import stagewise as sw

BATCH, LONGEST, REPEATED, MICROBATCHES, BUCKET = 8, 64, 60, 2, 16


@dataclass
class Config:
    """One way of training: a step function over a batch (returns its loss)."""

    name: str
    step: Callable[[dict], torch.Tensor]
    repeated_ms: list[float] = field(default_factory=list)
    new_ms: list[float] = field(default_factory=list)
    first_new_ms: float = float("nan")


def llama() -> LlamaForCausalLM:
    config = LlamaConfig(num_hidden_layers=4, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=128, max_position_embeddings=LONGEST,
                         attention_dropout=0.0, tie_word_embeddings=False, pad_token_id=0, bos_token_id=0,
                         eos_token_id=0)
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def batch(length: int, seed: int) -> dict:
    ids = torch.randint(1, 128, (BATCH, length), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "labels": ids.clone()}


def eager(model: torch.nn.Module) -> Callable[[dict], torch.Tensor]:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

    def step(inputs: dict) -> torch.Tensor:
        optimizer.zero_grad()
        loss = model(**inputs).loss
        loss.backward()
        optimizer.step()
        return loss.detach()

    return step


def configs() -> list[Config]:
    model = llama()
    example = batch(LONGEST, 0)
    result = [Config("eager", eager(copy.deepcopy(model))),
              Config("stagewise", pipeline_step(sw.compile(copy.deepcopy(model), 2, example,
                                                           microbatches=MICROBATCHES, cost="analytic")))]
    if "shape_buckets" in {f.name for f in fields(sw.TrainingOptions)}:
        pipe = sw.compile(copy.deepcopy(model), 2, example, microbatches=MICROBATCHES, cost="analytic",
                          training=sw.TrainingOptions(shape_buckets=BUCKET))
        result.append(Config(f"stagewise, shape_buckets={BUCKET}", pipeline_step(pipe)))
    return result


def pipeline_step(pipe: sw.Pipeline) -> Callable[[dict], torch.Tensor]:
    return lambda inputs: pipe.step(**inputs)


def timed(step: Callable[[dict], torch.Tensor], inputs: dict) -> float:
    start = time.perf_counter()
    step(inputs)
    return (time.perf_counter() - start) * 1e3


def run(configs_: list[Config], rounds: int) -> None:
    for config in configs_:  # warm-up: the example's shape
        for _ in range(3):
            config.step(batch(LONGEST, 1))
    for config in configs_:  # the first shape unlike the example: the repeated length, first seen
        config.first_new_ms = timed(config.step, batch(REPEATED, 2))
    for index in range(rounds):
        new = REPEATED - 2 - index
        for config in configs_:
            config.repeated_ms.append(timed(config.step, batch(REPEATED, 3 + index)))
            config.new_ms.append(timed(config.step, batch(new, 3 + index)))


def table(configs_: list[Config]) -> Table:
    result = Table(title="ms per step: a repeated sequence length against new ones (medians)")
    for column in ("configuration", "repeated", "new", "new / repeated", "first new", "new / eager's new"):
        result.add_column(column, justify="left" if column == "configuration" else "right")
    eager_new = statistics.median(configs_[0].new_ms)
    for config in configs_:
        repeated, new = statistics.median(config.repeated_ms), statistics.median(config.new_ms)
        result.add_row(config.name, f"{repeated:.1f}", f"{new:.1f}", f"{new / repeated:.2f}",
                       f"{config.first_new_ms:.0f}", f"{new / eager_new:.2f}")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=12, help="rounds of one repeated and one new step each")
    parser.add_argument("--no-pin", action="store_true", help="do not pin one intra-op thread per process")
    args = parser.parse_args()
    console = _common.start(args, width=120, fresh_cache=False)
    console.print(f"stagewise imported from {os.path.dirname(sw.__file__)}")
    console.print(f"model: HF Llama 4 x 64, batch {BATCH}, example length {LONGEST}, repeated length {REPEATED}, "
                  f"new lengths {REPEATED - 2} down; 2 CPU devices, {MICROBATCHES} microbatches")
    chosen = configs()
    run(chosen, args.rounds)
    console.print(table(chosen))


if __name__ == "__main__":
    main()
