"""The achieved FLOP/s of the model being planned, fitted from a few timed steps (Srifty §4.2).

A square matmul's rate is an upper bound no model meets: real layers mix small matmuls, norms,
softmax and the framework's per-op dispatch. Srifty instead times the model itself at four
microbatch sizes and fits its cost model to them; here that model is `time = overhead +
FLOPs / rate`, by least squares over the sizes: `rate` is what the model's work achieves on the
device in the plan's precision (the figure passes/analytic.py divides FLOPs by), `overhead` the
fixed per-step cost (dispatch, launches) that the slope leaves over. FLOPs are those of
forward + backward as torch.utils.flop_counter counts them, the same formulas the trace's
per-node FLOPs come from. A fit that comes out non-positive (noise on a small model, where the
overhead dominates) falls back to the best FLOPs / time ratio of the sizes, and says so.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import torch
from torch.utils._pytree import tree_map
from torch.utils.flop_counter import FlopCounterMode

from stagewise.catalogue.entries import Dtype
from stagewise.compiler.assembly.batches import batch_size
from stagewise.compiler.compile.calibrate import best_seconds
from stagewise.ir.errors import BatchSizeError, ExampleInputsError, LossError, ProfileError
from stagewise.ir.precision import autocast_for
from stagewise.passes.capture import Objective, input_names

PROBE_STEPS = 4  # Srifty's four microbatch sizes: B/8, B/4, B/2, B
MODEL_REPEATS = 3  # timed runs per size after one warm-up (the fastest counts)
AUTOCAST_PRECISION = {Dtype.FP32: "fp32", Dtype.TF32: "fp32", Dtype.BF16: "bf16", Dtype.FP16: "fp16"}


@dataclass(frozen=True)
class ModelFit:
    """The fitted `rate` (FLOP/s) and `overhead_s` of one forward + backward, the sizes, FLOPs and
    seconds it came from, and whether the least-squares fit held (else `rate` is the best ratio)."""

    model: str
    sizes: tuple[int, ...]
    flops: tuple[float, ...]
    seconds: tuple[float, ...]
    rate: float
    overhead_s: float
    fitted: bool

    @property
    def note(self) -> str:
        """The catalogue figure's note: how the rate was obtained, in a line."""
        where = f"{self.model} forward+backward at microbatches {', '.join(map(str, self.sizes))}"
        if self.fitted:
            return f"fitted over {where}: achieved rate, overhead {self.overhead_s * 1e3:.3g} ms"
        return (f"best FLOPs/time ratio over {where} (the fit time = overhead + FLOPs / rate was degenerate, "
                f"overhead {self.overhead_s * 1e3:.3g} ms: noise)")


def microbatch_sizes(batch: int) -> tuple[int, ...]:
    """B/8, B/4, B/2, B (rounded down, distinct, ascending): fewer for a small batch, at least two."""
    sizes = tuple(sorted({max(1, batch >> k) for k in range(PROBE_STEPS)}))
    if len(sizes) < 2:
        raise BatchSizeError(f"the example batch holds {batch} sample: the model probe fits time = overhead + "
                             "FLOPs / rate over at least two microbatch sizes; give example_inputs with a batch of "
                             "2 or more along dim 0 (8 gives sizes 1, 2, 4, 8)")
    return sizes


def fit_rate(flops: tuple[float, ...], seconds: tuple[float, ...]) -> tuple[float, float, bool]:
    """(rate, overhead, fitted) of seconds = overhead + flops / rate by least squares; where the slope or
    the intercept is not positive, (the best flops / seconds ratio, the intercept, False)."""
    design = np.stack([np.ones(len(flops)), np.asarray(flops, dtype=float)], axis=1)
    (overhead, slope), *_ = np.linalg.lstsq(design, np.asarray(seconds, dtype=float), rcond=None)
    if slope > 0 and overhead > 0 and len(set(flops)) > 1:
        return 1.0 / float(slope), float(overhead), True
    return max(f / s for f, s in zip(flops, seconds, strict=True)), float(overhead), False


def probe_model(model: torch.nn.Module, example_inputs, device: torch.device, precision: Dtype, *,
                loss_fn=None, example_target=None) -> ModelFit:
    """Time forward + backward of a copy of `model` on `device` at each of `microbatch_sizes`, count
    their FLOPs, and fit the achieved rate; the user's model, inputs and RNG are left as they were."""
    _check_has_data(model, example_inputs, example_target)
    _, kind = input_names(model, example_inputs)
    sizes = microbatch_sizes(batch_size(example_inputs, example_target))
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), tf32_only_for(precision):
        objective = Objective(copy.deepcopy(model).to(device), loss_fn, kind == "keyword")
        flops, seconds = [], []
        for size in sizes:
            step = _step(objective, _slice(example_inputs, size, device), _slice(example_target, size, device),
                         AUTOCAST_PRECISION[precision], device)
            flops.append(_counted_flops(step))
            seconds.append(best_seconds(step, device, repeats=MODEL_REPEATS))
    if not all(f > 0 for f in flops):
        raise ProfileError(f"{type(model).__name__} does no FLOPs torch.utils.flop_counter counts (matmuls, "
                           "convolutions, attention) at microbatch sizes "
                           f"{', '.join(map(str, sizes))}; probe without model= (the matmul probe) instead")
    rate, overhead, fitted = fit_rate(tuple(flops), tuple(seconds))
    return ModelFit(type(model).__name__, sizes, tuple(flops), tuple(seconds), rate, overhead, fitted)


def _step(objective: Objective, inputs, target, precision: str, device: torch.device) -> Callable[[], None]:
    """One forward (under the precision's autocast, as a stage forward runs) and backward, from zero grads."""
    def step() -> None:
        objective.zero_grad(set_to_none=True)
        with autocast_for(precision, device):
            loss = objective(inputs, target)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.requires_grad:
            raise LossError("the probe needs a scalar loss with an autograd graph from the model (and loss_fn); "
                            f"got {_describe(loss)}: pass loss_fn=(output, target) -> loss and example_target=, or "
                            "return a scalar loss that depends on a trainable parameter")
        loss.backward()
    return step


def _counted_flops(step: Callable[[], None]) -> float:
    with FlopCounterMode(display=False) as counter:
        step()
    return float(counter.get_total_flops())


def _slice(value, size: int, device: torch.device):
    """The first `size` samples (dim 0) of every batched tensor in `value`, on `device`."""
    def first(t):
        if not isinstance(t, torch.Tensor):
            return t
        return (t[:size] if t.dim() > 0 else t).to(device)
    return tree_map(first, value)


def _check_has_data(model: torch.nn.Module, example_inputs, example_target) -> None:
    """A meta-device model or input has shapes and no data: nothing can run to be timed."""
    if not isinstance(model, torch.nn.Module):
        raise ExampleInputsError(f"model= must be a torch.nn.Module, got {type(model).__name__}")
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if tensor.is_meta:
            raise ExampleInputsError(f"the model's {name!r} is on the meta device (shapes, no data), so it cannot be "
                                     "timed; materialise it first (model.to_empty(device='cpu') then load or "
                                     "initialise its weights), or probe without model= (the matmul probe)")
    values = list(example_inputs.values()) if isinstance(example_inputs, dict) else list(example_inputs or ())
    if any(isinstance(t, torch.Tensor) and t.is_meta for t in [*values, example_target]):
        raise ExampleInputsError("an example input or the target is on the meta device (no data), so the model "
                                 "cannot be timed; give real tensors on 'cpu' or the probed device")


@contextlib.contextmanager
def tf32_only_for(precision: Dtype) -> Iterator[None]:
    """TF32 matmuls and convolutions only when that is the precision probed (fp32 means plain fp32)."""
    matmul, cudnn = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = precision is Dtype.TF32
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = matmul, cudnn


def _describe(value: object) -> str:
    if isinstance(value, torch.Tensor):
        graph = "with" if value.requires_grad else "without"
        return f"a tensor of shape {tuple(value.shape)} {graph} an autograd graph"
    return f"a {type(value).__name__}"
