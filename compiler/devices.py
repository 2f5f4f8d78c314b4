"""Devices the pipeline runs on: user input (int, strings, torch.device, sw.Device) to one form."""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from stagewise.compiler.errors import DeviceError
from stagewise.compiler.ir import DeviceSpec

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def parse_bytes(value: int | str | None) -> int | None:
    """'512MiB' -> 536870912. Accepts ints and strings with B/KB/MB/GB/KiB/MiB/GiB."""
    if value is None or isinstance(value, int):
        return value
    match = re.fullmatch(r"\s*([0-9.]+)\s*([a-zA-Z]*)\s*", str(value))
    if not match or match.group(2).lower() not in _UNITS:
        raise DeviceError(f"cannot read memory size {value!r}; write it like 512MiB, 2GiB or 1000000")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


@dataclass(frozen=True)
class Device:
    """One device of the pipeline: where it is, how much memory the pool may use, how fast it is.

    Several `Device("cpu")` are distinct logical devices sharing the host CPU, which is how
    the tests and the demo run a 4-device pipeline on one machine.
    """

    name: str = "cpu"
    memory: int | str | None = None
    speed: float = 1.0

    def __post_init__(self):
        object.__setattr__(self, "memory", parse_bytes(self.memory))
        torch_device(self.name)

    @property
    def torch_device(self) -> torch.device:
        return torch_device(self.name)

    def spec(self) -> DeviceSpec:
        return DeviceSpec(name=self.name, kind=self.torch_device.type, memory=self.memory, speed=self.speed)


def torch_device(name: str | torch.device) -> torch.device:
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError) as err:
        raise DeviceError(
            f"unknown device {name!r}: use 'cpu', 'cuda', 'cuda:N' or a torch.device ({err})"
        ) from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise DeviceError(f"device {name!r} asks for CUDA but this machine has none; use 'cpu' devices")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise DeviceError(f"device {name!r} does not exist: this machine has {torch.cuda.device_count()} GPUs")
    if device.type not in ("cpu", "cuda"):
        raise DeviceError(f"device {name!r} is of type {device.type!r}; stagewise runs on 'cpu' and 'cuda'")
    return device


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
