"""What a plan's costs are made of beside each layer's `LayerCost`: the bytes of training state a
device holds per parameter byte, and what the runtime itself adds on the machine it runs on.

The training state of a parameter is its weights, its gradient (same dtype, same bytes) and the
optimizer's state (SGD none, SGD with momentum one copy, Adam/AdamW two moments). Every pass that
sizes training state from parameter bytes goes through the two functions here.

With AdamW that is 16 bytes per fp32 parameter, in fp32 and in bf16 alike: precision="bf16" is
autocast, which keeps fp32 weights (the masters), fp32 gradients and fp32 moments (4 + 4 + 8),
where mixed-precision training with separate bf16 copies keeps 2 + 2 + 12 (fp32 masters and
moments): the same 16 bytes (ZeRO, Rajbhandari et al. SC'20 §3.1: "2Ψ + 2Ψ + KΨ" with K = 12;
Hugging Face accelerate `estimate-memory`: "Training using Adam" is 4x the fp32 model's size).
DeepSpeed's ZeRO-2 estimator (`estimate_zero2_model_states_mem_needs`) adds fp32 gradient
partitions, 4 + 16/N bytes per parameter on N GPUs. tests/test_host_memory.py checks the plans.
"""

from __future__ import annotations

from dataclasses import dataclass

WEIGHT_AND_GRADIENT_BYTES = 2.0  # per parameter byte: the weights, and their gradients of the same size
ADAMW_OPTIMIZER_BYTES = 2.0  # per parameter byte: AdamW's two moments (the default where no optimizer is known)


def training_state_per_param_byte(optimizer_bytes: float) -> float:
    """Training-state bytes per parameter byte: weights + gradients + `optimizer_bytes` of optimizer
    state per parameter byte (0 when the optimizer steps on the host, where its state lives)."""
    return WEIGHT_AND_GRADIENT_BYTES + optimizer_bytes


def optimizer_state_per_param_byte(training_state: float) -> float:
    """The optimizer's share of `training_state` bytes per parameter byte: the inverse of
    `training_state_per_param_byte`."""
    return training_state - WEIGHT_AND_GRADIENT_BYTES


@dataclass(frozen=True)
class RuntimeCosts:
    """What executing a plan costs beyond its layers on this machine (measured by compile): the
    runtime's seconds per instruction, how in-process CPU devices slow each other when they
    compute at once, each layer's share of the optimizer step, and what splitting each layer's
    backward into zero bubble's B and W adds to it."""

    instruction_s: float = 0.0
    concurrency: tuple[float, ...] = ()
    update_s: tuple[float, ...] = ()  # per layer
    wake_s: float = 0.0  # a CPU device's compute right after it waited
    update_concurrency: tuple[float, ...] = ()  # as `concurrency`, for the optimizer step
    split_backward_s: tuple[float, ...] = ()  # per layer: a split backward's seconds beyond a whole one


NO_RUNTIME_COSTS = RuntimeCosts()  # a runtime that adds nothing: the layers' costs alone
