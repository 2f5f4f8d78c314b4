"""What each activation policy predicts for a 7B Llama on 4 x A100-40GB, side by side.

    python bench/activation_policy.py                      # keep, recompute, swap and auto
    python bench/activation_policy.py --policies auto swap

`sw.plan` (analytic costs, nothing timed here) of a meta-device Llama-2-7B-shaped config, bf16, AdamW,
8 x 2048 tokens in 8 microbatches, 1F1B on the catalogue's 4 x A100-40GB: per policy the predicted
iteration, each stage's policy and each device's predicted peak. "swap" is what the default chose
before the planner chose per stage (issue 24: swapping ~90% of the time). Nothing is asserted.
"""

from __future__ import annotations

import argparse
import functools
import time

import _common
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.utils import logging as hf_logging

import stagewise as sw

POLICIES = ("keep", "recompute", "swap", "auto")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policies", nargs="+", choices=POLICIES, default=list(POLICIES))
    args = parser.parse_args()
    hf_logging.set_verbosity_error()
    config = LlamaConfig(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=32, vocab_size=32000, max_position_embeddings=2048)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    ids = torch.randint(0, 32000, (8, 2048))
    cluster = sw.parse_device_request("4xA100-40GB", precision="bf16")
    print(_common.command_line())
    print(f"device memory {cluster.devices[0].memory / 2**30:.2f} GiB each")
    for policy in args.policies:
        started = time.perf_counter()
        plan = sw.plan(model, list(cluster.devices), {"input_ids": ids, "labels": ids}, precision="bf16",
                       schedule="1f1b", microbatches=8, optimizer=functools.partial(torch.optim.AdamW, lr=1e-4),
                       activations=policy)
        assert plan.predicted_iteration_s is not None
        peaks = ", ".join(f"{b / 2**30:.1f}" for b in plan.predicted_peak_bytes)
        print(f"{policy:<10} {plan.predicted_iteration_s:6.2f} s/iteration  stages: "
              f"{', '.join(str(s.activations) for s in plan.stages):<34} peaks GiB: {peaks}  "
              f"(planned in {time.perf_counter() - started:.0f} s)")


if __name__ == "__main__":
    main()
