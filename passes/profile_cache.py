"""Profiles cached on disk, keyed by the graph's structure, the device and the torch version.

Whether a cached entry is still to be trusted (it may have been timed under load) is the
profiler's call: it re-times one layer (stagewise.passes.profile).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.fx as fx

from stagewise.ir.devices import Device
from stagewise.ir.plan import Layer
from stagewise.passes.profile_fit import LayerProfile
from stagewise.passes.profile_layer import value_key

CACHE_VERSION = 3  # 3: times are the least disturbed of rounds (2: a median of runs back to back)


def cache_root() -> Path:
    """$STAGEWISE_CACHE, default ~/.cache/stagewise: profiles and this machine's figures live under it."""
    return Path(os.environ.get("STAGEWISE_CACHE") or Path.home() / ".cache" / "stagewise")


def cache_dir() -> Path:
    """$STAGEWISE_CACHE/profiles, default ~/.cache/stagewise/profiles."""
    return cache_root() / "profiles"


def cache_key(gm: fx.GraphModule, layers: Sequence[Layer], signatures: Sequence[str], device: Device,
              request: dict) -> str:
    """The graph's structure (its code, every value's shape, the layering), the device's name and
    kind, the torch version and what was asked for."""
    shapes = [(n.name, value_key(n.meta.get("val"))) for n in gm.graph.nodes]
    parts = [CACHE_VERSION, gm.code, shapes, [(lr.nodes, lr.params) for lr in layers], list(signatures),
             device.name, device.torch_device.type, _device_model(device), torch.__version__,
             sorted(request.items())]
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:24]


def _device_model(device: Device) -> str:
    where = device.torch_device
    return torch.cuda.get_device_name(where) if where.type == "cuda" else "cpu"


def load(key: str) -> list[LayerProfile] | None:
    """The profiles cached under `key`; None when there are none (or they cannot be read)."""
    path = cache_dir() / f"{key}.json"
    try:
        data = json.loads(path.read_text())
        return [LayerProfile.from_dict(p) for p in data["profiles"]]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def save(key: str, profiles: Sequence[LayerProfile]) -> None:
    """Write atomically; a cache that cannot be written is not an error."""
    path = cache_dir() / f"{key}.json"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"version": CACHE_VERSION, "profiles": [p.to_dict() for p in profiles]}))
        os.replace(tmp, path)
    except OSError:
        pass
