"""Devices the pipeline runs on: user input (int, strings, torch.device, sw.Device) to one form."""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass

import torch

from stagewise.ir.errors import DeviceError

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(value: int | str | None, what: str = "memory") -> int | None:
    """'512MiB' -> 536870912. Accepts positive ints and strings with B/KB/MB/GB/KiB/MiB/GiB
    (a pool of 0 bytes or fewer could hold nothing: refused here, not at the first step);
    `what` names the argument in the messages."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise DeviceError(f"{what}={value!r} is a {type(value).__name__}; write it like {what}='512MiB' or 1000000")
    match = re.fullmatch(r"\s*([0-9.]+(?:e[+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*", str(value))
    if isinstance(value, int):
        number = value
    elif not match or match.group(2).lower() not in _UNITS:
        raise DeviceError(f"cannot read {what} size {value!r}; write it like 512MiB, 2GiB or 1000000")
    elif not math.isfinite(scaled := float(match.group(1)) * _UNITS[match.group(2).lower()]):
        raise DeviceError(f"{what}={value!r} is no finite size; write it like {what}='512MiB' or 1000000")
    else:
        number = int(scaled)
    if number < 1:
        raise DeviceError(f"{what}={value!r} leaves no bytes; give a positive size such as "
                          f"{what}='512MiB', or {what}=None for no limit")
    return number


def machine_memory() -> int | None:
    """This machine's physical memory in bytes (what its CPU devices and every host copy share);
    None where the system does not say."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


_PREFIX = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12, "p": 10**15}


def parse_flops(value: float | str | None) -> float | None:
    """'100TFLOPS' -> 1e14. Accepts numbers and strings with k/M/G/T/P + FLOPS (or FLOP/s)."""
    if value is None:
        return None
    if not isinstance(value, str):
        return _positive(_number(value, "peak_flops", "312TFLOPS"), value, "peak_flops", "312TFLOPS")
    match = re.fullmatch(r"\s*([0-9.]+(?:e[+-]?[0-9]+)?)\s*([kmgtp]?)\s*(?:flops|flop/s)?\s*", value.lower())
    if not match:
        raise DeviceError(f"cannot read peak_flops {value!r}; write it like 312TFLOPS, 50GFLOPS or 1e14")
    return _positive(float(match.group(1)) * _PREFIX[match.group(2)], value, "peak_flops", "312TFLOPS")


def parse_bandwidth(value: float | str | None, what: str = "bandwidth") -> float | None:
    """'900GB/s' -> 9e11. Accepts numbers (bytes/s) and sizes as in `parse_bytes` followed by /s."""
    if value is None:
        return None
    if not isinstance(value, str):
        return _positive(_number(value, what, "900GB/s"), value, what, "900GB/s")
    match = re.fullmatch(r"\s*([0-9.]+(?:e[+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*(?:/\s*s|ps)?\s*", value)
    unit = match.group(2).lower() if match else ""
    if unit.endswith("ps") and unit[:-2] in _UNITS:  # 'GBps'
        unit = unit[:-2]
    if not match or unit not in _UNITS:
        raise DeviceError(f"cannot read {what} {value!r}; write it like 900GB/s, 16GiB/s or 1e10 (bytes/s)")
    return _positive(float(match.group(1)) * _UNITS[unit], value, what, "900GB/s")


def _positive(number: float, value, what: str, example: str) -> float:
    """`number`, checked: a rate of 0, below or NaN/inf would give nonsense predictions."""
    if not (number > 0 and math.isfinite(number)):
        raise DeviceError(f"{what}={value!r} must be a positive finite number, e.g. {what}={example!r}")
    return number


def _number(value, what: str, example: str) -> float:
    """A figure given as a number (not a bool, str or None)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise DeviceError(f"{what}={value!r} is a {type(value).__name__}; give a number or a string "
                          f"such as {what}={example!r}")
    return float(value)


def format_bytes(n: float) -> str:
    """536870912 -> '512.0 MiB' (the inverse of parse_bytes, for messages and tables)."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


@dataclass(frozen=True)
class DeviceSpec:
    """A serialisable description of one device of the plan."""

    name: str
    kind: str
    memory: int | None = None
    speed: float = 1.0
    peak_flops: float | None = None  # FLOP/s in the plan's precision, for analytic costs (passes/analytic.py)
    memory_bandwidth: float | None = None  # bytes/s of the device's own memory (roofline)
    host_bandwidth: float | None = None  # bytes/s of the host <-> device link (swaps)
    host_memory: int | None = None  # bytes of RAM of the device's host, shared with the devices on it
    host: int = 0  # which host (instance) the device is on: devices with the same host share its RAM


@dataclass(frozen=True)
class Device:
    """One device of the pipeline: where it is, how much memory the pool may use, how fast it is.

    Several `Device("cpu")` are distinct logical devices sharing the host CPU, which is how
    the tests and the demo run a 4-device pipeline on one machine.

    `peak_flops`, `memory_bandwidth` and `host_bandwidth` (host <-> device link, for swaps)
    describe hardware for analytic costs (passes/analytic.py), so one can plan for devices one
    does not have (`sw.plan`): `Device("cuda", memory="80GiB", peak_flops="989TFLOPS",
    memory_bandwidth="3.35TB/s")`; `peak_flops` is the rate in the plan's precision (bf16's for a
    bf16 plan). A device need not exist here until a runtime uses it (`compile`).

    Args:
        name: 'cpu', 'cuda', 'cuda:1' or a `torch.device`.
        memory: what the device's pool may hold, in bytes or as '512MiB' / '80GB'; None: no limit
            (neither the planner nor the pool bounds it).
        speed: relative speed against the other devices, for virtual devices and analytic costs.
        peak_flops: dense FLOP/s in the plan's precision, a number or '989TFLOPS'.
        memory_bandwidth: device memory bandwidth, bytes/s or '3.35TB/s'.
        host_bandwidth: the host <-> device link, bytes/s or '25GB/s' (what swaps cross).
        host_memory: the RAM of the device's host, bytes or '64GiB': what the plan keeps in host
            memory (swapped state and stashes, a host optimizer's state, the undo copies of each
            update) must fit in it, shared by every device of the same `host`. None: unbounded,
            except a CPU device, whose host is this machine (its physical memory).
        host: which host (instance) the device is on, from 0; devices with the same host share
            its `host_memory` (the smallest any of them states).

    Raises:
        DeviceError: a name that is not a device, a size, rate or speed that does not parse or is
            not positive, a host that is not a whole number from 0.

    Example:
        >>> sw.Device("cpu", memory="512MiB", peak_flops="1TFLOPS")
        Device(name='cpu', memory=536870912, speed=1.0, peak_flops=1000000000000.0, memory_bandwidth=None, host_bandwidth=None, host_memory=None, host=0)
        >>> sw.Device("cuda", memory="24GB", host_memory="16GiB").host_memory
        17179869184
        >>> sw.Device("cpu", speed=0)
        Traceback (most recent call last):
        ...
        stagewise.ir.errors.DeviceError: speed=0 must be a positive finite number, e.g. speed=1.0
    """

    name: str = "cpu"
    memory: int | str | None = None
    speed: float = 1.0
    peak_flops: float | str | None = None
    memory_bandwidth: float | str | None = None
    host_bandwidth: float | str | None = None
    host_memory: int | str | None = None
    host: int = 0

    def __post_init__(self):
        object.__setattr__(self, "memory", parse_bytes(self.memory))
        object.__setattr__(self, "host_memory", parse_bytes(self.host_memory, "host_memory"))
        if isinstance(self.host, bool) or not isinstance(self.host, int) or self.host < 0:
            raise DeviceError(f"host={self.host!r}: give the index of the device's host, a whole number from 0 "
                              "(devices with the same host share its host_memory)")
        object.__setattr__(self, "peak_flops", parse_flops(self.peak_flops))
        object.__setattr__(self, "memory_bandwidth", parse_bandwidth(self.memory_bandwidth, "memory_bandwidth"))
        object.__setattr__(self, "host_bandwidth", parse_bandwidth(self.host_bandwidth, "host_bandwidth"))
        if isinstance(self.speed, bool) or not isinstance(self.speed, int | float):
            raise DeviceError(f"speed={self.speed!r} is a {type(self.speed).__name__}; give a relative speed such as 1.0")
        _positive(float(self.speed), self.speed, "speed", 1.0)
        if not isinstance(self.name, str | torch.device):
            raise DeviceError(f"device name {self.name!r} is a {type(self.name).__name__}; "
                              "give 'cpu', 'cuda:0' or a torch.device")
        torch_device(self.name)

    @property
    def torch_device(self) -> torch.device:
        """The `torch.device` this device computes on (several 'cpu' devices share one).

        Example:
            >>> sw.Device("cpu").torch_device
            device(type='cpu')
        """
        return torch_device(self.name)

    def spec(self) -> DeviceSpec:
        """The plan's record of this device, its figures in bytes and per second (parsed at construction).

        Returns:
            The `DeviceSpec` a plan stores, with the device's kind ('cpu', 'cuda').

        Example:
            >>> sw.Device("cpu", memory="1KiB").spec().memory
            1024
        """
        return DeviceSpec(
            name=self.name,
            kind=self.torch_device.type,
            memory=_parsed(self.memory),
            speed=self.speed,
            peak_flops=_parsed(self.peak_flops),
            memory_bandwidth=_parsed(self.memory_bandwidth),
            host_bandwidth=_parsed(self.host_bandwidth),
            host_memory=self._host_memory(),
            host=self.host,
        )

    def _host_memory(self) -> int | None:
        """The RAM stated, or for a CPU device this machine's: its pool is that RAM too."""
        stated = _parsed(self.host_memory)
        if stated is None and self.torch_device.type == "cpu":
            return machine_memory()
        return stated


def _parsed(value: int | float | str | None):
    """A figure `__post_init__` parsed (a string left would be a bug of this module)."""
    if isinstance(value, str):
        raise TypeError(f"unparsed device figure {value!r}")
    return value


def torch_device(name: str | torch.device) -> torch.device:
    """The torch.device a name describes, whether or not this machine has it (one can plan for GPUs
    on a laptop); `check_present` is what a runtime asks before it uses the devices."""
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError) as err:
        raise DeviceError(
            f"unknown device {name!r}: use 'cpu', 'cuda', 'cuda:N' or a torch.device ({err})"
        ) from None
    if device.type not in ("cpu", "cuda"):
        raise DeviceError(f"device {name!r} is of type {device.type!r}; stagewise runs on 'cpu' and 'cuda'")
    return device


def check_present(devices: list[Device]) -> None:
    """Every device exists on this machine, so a runtime can run on it."""
    for device in devices:
        where = device.torch_device
        if where.type == "cuda" and not torch.cuda.is_available():
            raise DeviceError(f"device {device.name!r} asks for CUDA but this machine has none; use 'cpu' devices")
        if where.type == "cuda" and where.index is not None and where.index >= torch.cuda.device_count():
            raise DeviceError(f"device {device.name!r} does not exist: this machine has "
                              f"{torch.cuda.device_count()} GPUs")


def resolve_devices(devices) -> list[Device]:
    """An int (that many default devices), or a list of str / torch.device / Device."""
    if isinstance(devices, bool) or devices is None:
        raise DeviceError(f"devices must be an int or a list of devices, got {devices!r}")
    if isinstance(devices, int):
        if devices < 1:
            raise DeviceError(f"devices={devices}: give at least one device, e.g. devices=2")
        if torch.cuda.is_available():
            count = torch.cuda.device_count()
            return [Device(f"cuda:{i % count}") for i in range(devices)]
        return [Device("cpu") for _ in range(devices)]
    if isinstance(devices, str | torch.device | Device):
        devices = [devices]
    if not isinstance(devices, list | tuple):
        raise DeviceError(f"devices must be an int or a list of devices, got {type(devices).__name__}")
    if not devices:
        raise DeviceError("devices is empty: give at least one device, e.g. devices=['cpu', 'cpu']")
    resolved = []
    for item in devices:
        if isinstance(item, Device):
            resolved.append(item)
        elif isinstance(item, str | torch.device):
            resolved.append(Device(str(item)))
        else:
            raise DeviceError(
                f"cannot use {item!r} as a device: give a string ('cpu', 'cuda:0'), torch.device or sw.Device"
            )
    return resolved
