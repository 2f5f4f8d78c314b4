"""How many pipeline positions a schedule needs, and which device runs each stage instance.

- gpipe, 1f1b, varuna: P = N / D positions, D data-parallel replicas of the pipeline
  (instance (s, r) on device r * P + s: the P x D configurations of Varuna §4.4); a smaller P
  (`stages`) leaves the last N - P x D devices idle.
- interleaved: P = v N positions, stage s on device s mod N (Megatron's virtual stages).
- harmony-pp: P packs bound wrap-around, pack k on device k mod N (Harmony §3.2).
- harmony-dp: P packs, every device runs all of them on its own microbatches (D = N).

Harmony uses more packs than devices so that a pack's state fits a device that cannot hold
its share of the model: at least two packs per device, more when the memory asks for it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from stagewise.ir.errors import PartitionError

VIRTUAL_STAGES = 2  # model chunks per device under the interleaved schedule


@dataclass(frozen=True)
class Layout:
    positions: int  # logical stages (packs)
    replicas: int
    device_of: Callable[[int, int], int]  # (position, replica) -> device


def choose_layout(
    schedule: str, n_devices: int, replicas: int, legal_cuts: int, param_bytes: int, capacity: int | None,
    state_per_param_byte: float, stages: int | None = None,
) -> Layout:
    """`state_per_param_byte`: training-state bytes per weight byte (ir/costs.py `training_state_per_param_byte`);
    `stages`: the pipeline depth P of gpipe / 1f1b / varuna (default N / D)."""
    n, d = n_devices, replicas
    if stages is not None and schedule not in ("gpipe", "1f1b", "varuna"):
        raise PartitionError(f"stages= sets the depth of a gpipe, 1f1b or varuna pipeline; {schedule} places its own")
    if schedule in ("harmony-pp", "harmony-dp"):
        if d != 1:
            raise PartitionError(f"{schedule} chooses its own data parallelism; drop replicas={d}")
        per_lane = n if schedule == "harmony-pp" else 1
        packs = max(2 * per_lane, _packs_for_memory(param_bytes * state_per_param_byte, capacity))
        packs = min(packs, legal_cuts + 1)
        if schedule == "harmony-pp":
            return Layout(packs, 1, lambda s, r: s % n)
        return Layout(packs, n, lambda s, r: r)
    if schedule == "interleaved":
        if d != 1:
            raise PartitionError("the interleaved schedule runs without data-parallel replicas; drop replicas=")
        return Layout(n * VIRTUAL_STAGES, 1, lambda s, r: s % n)
    if n % d:
        raise PartitionError(f"replicas={d} must divide the {n} devices")
    p = n // d if stages is None else stages
    if not 1 <= p <= n // d:
        raise PartitionError(f"stages={stages} with replicas={d} needs {p * d} of the {n} devices; use at most {n // d}")
    return Layout(p, d, lambda s, r: r * p + s)


def _packs_for_memory(state_bytes: float, capacity: int | None) -> int:
    """Packs so that two packs' training state fit one device (double buffering)."""
    if capacity is None:
        return 1
    return math.ceil(2 * state_bytes / capacity)
