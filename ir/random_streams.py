"""Keyed random streams: each random op of a stage draws from a stream of its own, determined by
(seed, step, op, microbatch), never from the position of torch's one global generator.

Why: a stage's forward runs on a thread beside the other stages' and a recompute runs it again,
so draws taken from the shared global generator would depend on how the threads interleave, and
a recompute would draw new masks: the gradients would belong to another network than the loss.
Keyed by the whole model's op (its place among the graph's random ops, passes/random_ops.py),
the global microbatch index and the number of completed steps, a draw is the same in a forward
and its recompute, and the same whatever the partition, schedule, device count or process count.

Generated stage code calls `keyed_dropout` (dropout, the common case: a seeded generator of this
thread, no lock) and `keyed` (any other random op: run under a lock with the global generators
of the CPU and of the op's CUDA devices seeded from the key and restored after, so the user's own
stream does not move). The runtime enters `drawing(seed, step, microbatch)` around each forward
and recompute. Outside `drawing` (a stage module called by hand, the profiler) both behave as the
op they replace, drawing from the global generator.
"""

from __future__ import annotations

import contextlib
import enum
import hashlib
import struct
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.overrides import handle_torch_function, has_torch_function, has_torch_function_unary


@dataclass(frozen=True)
class DrawKey:
    """What a forward's draws are keyed by besides the op: the plan's seed, the number of completed
    steps and the global microbatch index; `training`: the stage's mode (in eval mode dropout keeps
    its input, whatever mode the graph was traced in)."""

    seed: int
    step: int
    microbatch: int
    training: bool = True

    def stream_seed(self, op: int) -> int:
        """The 64-bit seed of op `op`'s stream (a hash: neighbouring keys give unrelated streams)."""
        packed = struct.pack("<4Q", self.seed, self.step, op, self.microbatch)
        return int.from_bytes(hashlib.blake2b(packed, digest_size=8).digest(), "little")


class _ThreadState(threading.local):
    key: DrawKey | None = None
    generators: dict[torch.device, torch.Generator]

    def __init__(self) -> None:
        self.generators = {}


_thread = _ThreadState()
_global_generators = threading.Lock()  # one keyed draw at a time may seed the global generators


class _Drawing:
    """`drawing`'s context: a plain object, not a generator's (entered around every forward)."""

    __slots__ = ("key", "previous")

    def __init__(self, key: DrawKey):
        self.key = key
        self.previous: DrawKey | None = None

    def __enter__(self) -> DrawKey:
        self.previous, _thread.key = _thread.key, self.key
        return self.key

    def __exit__(self, *exc: object) -> None:
        _thread.key = self.previous


def drawing(seed: int, step: int, microbatch: int, training: bool = True) -> _Drawing:
    """Random ops this thread runs inside draw from the streams of (seed, step, op, microbatch);
    dropout draws only while `training`."""
    return _Drawing(DrawKey(seed, step, microbatch, training))


def current_key() -> DrawKey | None:
    """The key this thread draws under (None outside `drawing`)."""
    return _thread.key


def keyed_dropout(op: int, input: torch.Tensor, p: float = 0.5, train: bool = True,  # noqa: A002 - torch's name
                  inplace: bool = False) -> torch.Tensor:
    """`F.dropout` with its mask drawn from op `op`'s stream (eager's formula: input * mask / (1 - p))."""
    if has_torch_function_unary(input):  # fx re-tracing saved stage code records the call as it is
        return handle_torch_function(keyed_dropout, (input,), op, input, p, train, inplace)
    if p < 0.0 or p > 1.0:
        raise ValueError(f"dropout probability has to be between 0 and 1, but got {p}")
    key = _thread.key
    if key is None:
        return F.dropout(input, p, train, inplace)
    if p == 0.0 or not train or not key.training or input.numel() == 0:
        return input
    if p == 1.0:
        return input.mul_(0) if inplace else input * torch.zeros((), dtype=input.dtype, device=input.device)
    noise = torch.empty_like(input).bernoulli_(1 - p, generator=_generator(input.device, key.stream_seed(op)))
    noise.div_(1 - p)
    return input.mul_(noise) if inplace else input * noise


def _generator(device: torch.device, seed: int) -> torch.Generator:
    """This thread's generator on `device`, seeded with `seed` (generators are not shared between threads)."""
    generator = _thread.generators.get(device)
    if generator is None:
        generator = _thread.generators[device] = torch.Generator(device)
    return generator.manual_seed(seed)


class TorchRandom(enum.Enum):
    """torch-level random functions and tensor methods as an fx trace records them, by name so that
    generated code can call them through `keyed` (torch.export graphs name ATen ops instead)."""

    dropout1d = enum.member(F.dropout1d)
    dropout2d = enum.member(F.dropout2d)
    dropout3d = enum.member(F.dropout3d)
    alpha_dropout = enum.member(F.alpha_dropout)
    feature_alpha_dropout = enum.member(F.feature_alpha_dropout)
    rrelu = enum.member(F.rrelu)
    gumbel_softmax = enum.member(F.gumbel_softmax)
    scaled_dot_product_attention = enum.member(F.scaled_dot_product_attention)
    torch_dropout = enum.member(torch.dropout)
    rand = enum.member(torch.rand)
    randn = enum.member(torch.randn)
    randint = enum.member(torch.randint)
    randperm = enum.member(torch.randperm)
    rand_like = enum.member(torch.rand_like)
    randn_like = enum.member(torch.randn_like)
    randint_like = enum.member(torch.randint_like)
    bernoulli = enum.member(torch.bernoulli)
    normal = enum.member(torch.normal)
    multinomial = enum.member(torch.multinomial)
    poisson = enum.member(torch.poisson)
    tensor_bernoulli = enum.member(torch.Tensor.bernoulli)
    tensor_bernoulli_ = enum.member(torch.Tensor.bernoulli_)
    tensor_uniform_ = enum.member(torch.Tensor.uniform_)
    tensor_normal_ = enum.member(torch.Tensor.normal_)
    tensor_random_ = enum.member(torch.Tensor.random_)
    tensor_exponential_ = enum.member(torch.Tensor.exponential_)
    tensor_geometric_ = enum.member(torch.Tensor.geometric_)
    tensor_cauchy_ = enum.member(torch.Tensor.cauchy_)
    tensor_log_normal_ = enum.member(torch.Tensor.log_normal_)
    tensor_multinomial = enum.member(torch.Tensor.multinomial)


def keyed(op: int, function: TorchRandom | torch._ops.OpOverload | torch.nn.Module, *args, **kwargs):
    """`function(*args, **kwargs)` drawing from op `op`'s stream: under a lock, with the global
    generators of the CPU and of the CUDA devices involved seeded from the key, restored after.
    For ops that take no generator (SDPA's dropout, a torch.nn module with dropout inside)."""
    relevant = _arguments(args, kwargs)
    if has_torch_function(relevant):  # fx re-tracing saved stage code records the call as it is
        return handle_torch_function(keyed, relevant, op, function, *args, **kwargs)
    call = function.value if isinstance(function, TorchRandom) else function
    key = _thread.key
    if key is None:
        return call(*args, **kwargs)
    if not key.training and call in _ATTENTION:  # eval mode: attention's dropout traced in train mode is off
        args, kwargs = _without_dropout(args, kwargs)
    with _global_generators_seeded(key.stream_seed(op), _cuda_devices(relevant)):
        return call(*args, **kwargs)


_ATTENTION = (F.scaled_dot_product_attention, torch.ops.aten.scaled_dot_product_attention.default)


def _without_dropout(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Attention's arguments (query, key, value, attn_mask, dropout_p, ...) with dropout_p 0."""
    if len(args) > 4:
        return (*args[:4], 0.0, *args[5:]), kwargs
    return args, {**kwargs, "dropout_p": 0.0}


def _arguments(args: tuple, kwargs: dict) -> tuple:
    """The arguments, lists and tuples among them opened (ops take tensors at most one level deep;
    pytree's flatten costs more than a small op)."""
    flat: list = []
    for value in (*args, *kwargs.values()):
        if isinstance(value, list | tuple):
            flat.extend(value)
        else:
            flat.append(value)
    return tuple(flat)


def _cuda_devices(values: tuple) -> list[int]:
    """The CUDA devices among the tensors and devices of an op's arguments."""
    devices = {v.device if isinstance(v, torch.Tensor) else v for v in values if isinstance(v, torch.Tensor | torch.device)}
    return sorted({d.index or 0 for d in devices if d.type == "cuda"})


@contextlib.contextmanager
def _global_generators_seeded(seed: int, cuda: list[int]) -> Iterator[None]:
    """The CPU's and `cuda` devices' default generators seeded with `seed`, and as they were after."""
    with _global_generators:
        cpu_state = torch.default_generator.get_state()
        cuda_states = [torch.cuda.default_generators[i].get_state() for i in cuda]
        try:
            torch.default_generator.manual_seed(seed)
            for i in cuda:
                torch.cuda.default_generators[i].manual_seed(seed)
            yield
        finally:
            torch.default_generator.set_state(cpu_state)
            for i, state in zip(cuda, cuda_states, strict=True):
                torch.cuda.default_generators[i].set_state(state)
