"""The issue's 7B example: each plan's predicted iteration beside the PCIe bound it must respect.

    python bench/host_links.py                                   # g6.xlarge, a2-highgpu-1g, 2xa2-highgpu-1g
    python bench/host_links.py --candidates 4xA100-40GB

`stagewise recommend llama-7b/config.json --precision bf16` plans a Llama 7B-shaped model (the
command line's 8 x 1024 random tokens, AdamW) on each candidate, on the meta device. Every swap and
stash crosses its device's host link (PCIe), shared by the devices of one instance, so an
iteration can be no shorter than the bytes a host moves in one direction over that link. Printed
per candidate: the prediction, each host's bytes in and out, its link, and that bound; the
prediction is above it wherever the plan swaps. Nothing here is asserted, and nothing is timed:
the figures are the analytic model's, the same on a busy machine.
"""

from __future__ import annotations

import argparse
import functools

import _common
import torch
from rich.console import Console
from rich.table import Table
from transformers import LlamaConfig, LlamaForCausalLM

import stagewise as sw
from stagewise.cli.models import token_batch
from stagewise.compiler.advice.device_mix import mix_of

ADAMW = functools.partial(torch.optim.AdamW, lr=1e-4)
GIB = 2**30


def llama_7b() -> LlamaForCausalLM:
    config = LlamaConfig(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=32, vocab_size=32000, max_position_embeddings=2048)
    with torch.device("meta"):
        return LlamaForCausalLM(config)


def row(request: str, model: torch.nn.Module, inputs: dict) -> list[str]:
    """One candidate planned as `stagewise recommend` plans it, its prediction and its PCIe bound."""
    mix = mix_of(request, sw.load_catalogue(), "bf16")
    plan = sw.plan(model, mix.devices, inputs, optimizer=ADAMW, precision="bf16", topology=mix.topology())
    result, topology = sw.simulate(plan), plan.costs.topology
    hosts: dict[int, list[float]] = {}
    for device in result.swap_in_bytes:
        moved = hosts.setdefault(topology.host_of(device), [0.0, 0.0, topology.host_link(device)])
        moved[0] += result.swap_in_bytes[device]
        moved[1] += result.swap_out_bytes[device]
    bound = max((max(i, o) / link for i, o, link in hosts.values()), default=0.0)
    moved_text = ", ".join(f"{i / GIB:.0f} / {o / GIB:.0f}" for i, o, _ in hosts.values())
    links = ", ".join(f"{link / 1e9:g}" for *_, link in hosts.values())
    return [request, f"{plan.schedule} x{plan.microbatches}", f"{result.iteration_time:.2f} s", moved_text, links,
            f"{bound:.2f} s", f"{result.iteration_time / bound:.2f}" if bound else "-"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--candidates", nargs="+", default=["g6.xlarge", "a2-highgpu-1g", "2xa2-highgpu-1g"])
    args = parser.parse_args()
    model = llama_7b()
    inputs = token_batch(model, 8, None)
    table = Table(title=f"Llama 7B-shaped, bf16 AdamW, 8 x 1024 tokens: `{_common.command_line()}`")
    for column in ("devices", "plan", "predicted", "GiB in / out per host", "host link GB/s",
                   "bytes / host link", "predicted / bound"):
        table.add_column(column, justify="left" if column in ("devices", "plan") else "right")
    for request in args.candidates:
        table.add_row(*row(request, model, inputs))
    Console(width=160).print(table)


if __name__ == "__main__":
    main()
