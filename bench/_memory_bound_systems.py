"""The three ways `memory_bound.py` trains its GPT: eager, stagewise with swapping, FSDP2 with CPU offload.

Not a benchmark itself. Each system is built from the same seeded model and trains the same batches;
`measure` times any of them alike and returns a `Row`. Every system trains the GPT in bf16 with
AdamW: eager and stagewise as fp32 weights under `torch.autocast` (stagewise's precision="bf16"),
FSDP2 as fp32 sharded weights cast to bf16 for compute (`MixedPrecisionPolicy`).
"""

from __future__ import annotations

import dataclasses
import functools
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from transformers import GPT2Config, GPT2LMHeadModel

import stagewise as sw

Batch = dict[str, torch.Tensor]
GiB = 2**30


@dataclass
class Row:
    """One system's figures: what the table and the JSON print."""

    system: str
    step_s: float = float("nan")
    tokens_per_s: float = float("nan")
    peak_gib: float | None = None  # torch.cuda.max_memory_allocated over the system's run; None on CPU
    last_loss: float = float("nan")
    bound: str = ""  # what bounds it, in words with the measured figures behind them
    error: str = ""  # why it did not run (an out-of-memory, a plan that does not fit)
    extra: dict[str, float] = field(default_factory=dict)


def gpt(layers: int, dim: int, heads: int, vocab: int, seq: int, device: str) -> GPT2LMHeadModel:
    """The benchmark's GPT-2 (tied head, dropout off), random weights seeded alike for every system,
    built on `device` (a 1.3B model initialises in milliseconds on a GPU, seconds on the host)."""
    config = GPT2Config(n_layer=layers, n_embd=dim, n_head=heads, vocab_size=vocab, n_positions=seq,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    with torch.device(device):
        return GPT2LMHeadModel(config)


def batches(count: int, batch: int, seq: int, vocab: int) -> list[Batch]:
    """Random token ids (labels = inputs: the model shifts them), on the host."""
    generator = torch.Generator().manual_seed(1)
    out = []
    for _ in range(count):
        ids = torch.randint(0, vocab, (batch, seq), generator=generator)
        out.append({"input_ids": ids, "labels": ids.clone()})
    return out


def on(batch: Batch, device: str) -> Batch:
    return {name: tensor.to(device, non_blocking=True) for name, tensor in batch.items()}


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def measure(row: Row, step: Callable[[Batch], float], data: list[Batch], warmup: int, device: str) -> Row:
    """`step` over `data`: the first `warmup` steps untimed (lazy optimizer state, allocator), the
    median of the rest; the peak over all of them."""
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    times = []
    for i, batch in enumerate(data):
        synchronize(device)
        start = time.perf_counter()
        row.last_loss = step(batch)  # a float: the host has seen the loss, so the step is done
        synchronize(device)
        if i >= warmup:
            times.append(time.perf_counter() - start)
    times.sort()
    row.step_s = times[len(times) // 2]
    tokens = data[0]["input_ids"].numel()
    row.tokens_per_s = tokens / row.step_s
    if device.startswith("cuda"):
        row.peak_gib = torch.cuda.max_memory_allocated() / GiB
    return row


def adamw(lr: float) -> Callable[..., torch.optim.Optimizer]:
    return functools.partial(torch.optim.AdamW, lr=lr)


# ---- eager ---------------------------------------------------------------------------------------------
def eager_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, device: str) -> Callable[[Batch], float]:
    """One eager step: the forward under bf16 autocast, fp32 weights, gradients and AdamW state."""
    kind = torch.device(device).type

    def step(batch: Batch) -> float:
        with torch.autocast(kind, torch.bfloat16):
            loss = model(**on(batch, device)).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach().item()

    return step


def activation_bytes(model: torch.nn.Module, batch: Batch, device: str) -> int:
    """What autograd keeps from one eager forward of `batch` (distinct storages, weights excluded):
    the activation term of eager's need."""
    resident = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        with torch.autocast(torch.device(device).type, torch.bfloat16):
            model(**on(batch, device))
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in saved}
    return sum(size for ptr, size in storages.items() if ptr not in resident)


# ---- stagewise -------------------------------------------------------------------------------------------
def stagewise_device(device: str, memory: int, catalogue_name: str | None) -> sw.Device:
    """The capped device as a user states it: the catalogue's figures for this GPU (analytic costs
    need its FLOP/s and PCIe rate) with `memory` as its capacity; a bare capped device on the CPU."""
    if catalogue_name is None:
        return sw.Device(device, memory=memory)
    listed = sw.parse_device_request(f"1x{catalogue_name}", precision="bf16").devices[0]
    return dataclasses.replace(listed, name=device, memory=memory, host_memory=None)


def compile_stagewise(model: torch.nn.Module, example: Batch, target: sw.Device, lr: float,
                      optimizer_on_host: bool) -> sw.Pipeline:
    """stagewise on the one capped device: swap="auto" (the planner moves state and stashes to host
    memory where the device cannot hold them), analytic costs (nothing profiled under the cap)."""
    return sw.compile(model, [target], example, optimizer=adamw(lr), precision="bf16", cost="analytic",
                      memory=sw.MemoryOptions(swap="auto", optimizer_on_host=optimizer_on_host))


def stagewise_step(pipe: sw.Pipeline) -> Callable[[Batch], float]:
    return lambda batch: float(pipe.step(**batch))


def stagewise_bound(pipe: sw.Pipeline, before: dict, row: Row) -> str:
    """The last step's measured split (time_breakdown: compute against the busier swap stream, which
    also runs a host optimizer), its host<->device bytes (pool counters), and the plan's predicted
    split and bound, in one line."""
    times, after = pipe.time_breakdown()[0], pipe.stats[0]
    moved = sum(float(after[k] or 0) - float(before[k] or 0) for k in ("swap_in_bytes", "swap_out_bytes"))
    row.extra.update(pcie_gb_per_step=moved / 1e9, compute_s=times.compute_s, waiting_s=times.waiting_s,
                     swap_in_s=times.swap_in_s, swap_out_s=times.swap_out_s,
                     pool_peak_gib=float(after["peak_bytes"] or 0) / GiB)
    busiest_copy = max(times.swap_in_s, times.swap_out_s)
    measured = "PCIe / host (swap streams)" if busiest_copy > times.compute_s else "compute"
    plan = pipe.plan
    return (f"compute {times.compute_s:.2f} s, waiting {times.waiting_s:.2f} s of {times.step_s:.2f} s; "
            f"swap streams in {times.swap_in_s:.2f} s / out {times.swap_out_s:.2f} s; "
            f"{moved / 1e9:.2f} GB host<->device per step ({moved / 1e9 / times.step_s:.1f} GB/s) — "
            f"measured bound: {measured}; plan {plan.schedule} x{plan.microbatches}, predicted {plan.predicted_split}")


# ---- FSDP2 ---------------------------------------------------------------------------------------------
def world_of_one(device: str) -> None:
    """A world-size-1 process group in this process (NCCL on a GPU, gloo on the CPU), through a file store."""
    store = dist.FileStore(tempfile.NamedTemporaryFile(delete=False).name, 1)
    dist.init_process_group("nccl" if device.startswith("cuda") else "gloo", store=store, rank=0, world_size=1)


def fsdp2(model: GPT2LMHeadModel, device: str, checkpointing: bool) -> GPT2LMHeadModel:
    """fully_shard with CPUOffloadPolicy (sharded fp32 weights, gradients and AdamW state on the host,
    the update there too), bf16 compute, fp32 reduce: each block, then the root, as FSDP2's docs say.
    On the CPU the policy does not pin (pinning needs a GPU). With `checkpointing` each block
    recomputes its activations in the backward (Hugging Face's gradient checkpointing), as FSDP2 must
    where the cap cannot hold a whole batch's."""
    if checkpointing:
        model.config.use_cache = False
        recompute_kwargs = {"use_reentrant": False}
        if hasattr(model, "activation_checkpointing_enable"):  # its name from transformers 5.x on
            model.activation_checkpointing_enable(recompute_kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=recompute_kwargs)
    from torch.distributed.device_mesh import init_device_mesh  # noqa: PLC0415 - only with a process group
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard  # noqa: PLC0415

    mesh = init_device_mesh(torch.device(device).type, (1,))
    options = {"mesh": mesh, "mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
               "offload_policy": CPUOffloadPolicy(pin_memory=device.startswith("cuda"))}
    for block in model.transformer.h:
        fully_shard(block, **options)
    fully_shard(model, **options)
    return model


def fsdp2_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, device: str,
               split: dict[str, float]) -> Callable[[Batch], float]:
    """One FSDP2 step; `split` keeps the last step's forward + backward and host optimizer seconds."""

    def step(batch: Batch) -> float:
        start = time.perf_counter()
        loss = model(**on(batch, device)).loss
        loss.backward()
        synchronize(device)  # the gradients have reached the host: what is left is the host's AdamW
        middle = time.perf_counter()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        split.update(forward_backward_s=middle - start, optimizer_s=time.perf_counter() - middle)
        return loss.detach().item()

    return step


def fsdp2_bound(split: dict[str, float], parameters: int, eager_step_s: float | None, row: Row) -> str:
    """Host AdamW against forward + backward (measured), the latter against eager's whole step where
    eager ran (what is above it is FSDP2's weight copies and their waits), and the bytes FSDP2 moves
    per step (derived: fp32 weights in for the forward and again for the backward, fp32 gradients out)."""
    moved = 3 * 4 * parameters
    row.extra.update(split, pcie_gb_per_step=moved / 1e9)
    forward_backward, host = split["forward_backward_s"], split["optimizer_s"]
    exposed = forward_backward - eager_step_s if eager_step_s is not None else None
    if host > forward_backward:
        bound = "host optimizer"
    elif exposed is not None and exposed > eager_step_s:
        bound = "weight copies in and gradients out (PCIe on a GPU)"
    else:
        bound = "compute" if exposed is not None else "forward+backward (no eager row to split it)"
    above = f", {exposed:.2f} s above eager's whole step" if exposed is not None else ""
    return (f"forward+backward {forward_backward:.2f} s{above} ({moved / 1e9:.2f} GB of weights in and "
            f"gradients out per step, derived), host AdamW {host:.2f} s ({host / (host + forward_backward):.0%} "
            f"of the step) — measured bound: {bound}")
