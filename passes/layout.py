"""How many pipeline positions a schedule needs, and which device runs each stage instance.

- gpipe, 1f1b, varuna: P = N / D positions, D data-parallel replicas of the pipeline
  (the P x D configurations of Varuna §4.4), grouped one of two ways (`Grouping`): each copy of
  the pipeline on consecutive devices (instance (s, r) on device r * P + s), or each stage's D
  copies on consecutive devices (on device s * D + r). Devices are numbered host by host (torchrun's
  ranks, compiler/compile/cluster.py), so the second keeps each stage's data-parallel all-reduce
  within a host and sends the activations across hosts: Narayanan et al. §3's rule for a fast
  link inside a server and a slow one between servers. A smaller P (`stages`) leaves the last
  N - P x D devices idle.
- interleaved: P = v N positions, stage s on device s mod N (Megatron's virtual stages).
- zb-v: P = 2N positions in a V, stage s on device s for s < N, else 2N - 1 - s (Qi et al. §6).
- harmony-pp: P packs bound wrap-around, pack k on device k mod N (Harmony §3.2).
- harmony-dp: P packs, every device runs all of them on its own microbatches (D = N).
- gpipe, 1f1b with stages replicated each their own way (replicas=(2, 1) or "per-stage",
  PipeDream §2.4.1): the DP places them (passes/pipedream_partition.py), not the layout.

For Harmony the positions are the fewest packs: one per device of a lane, and a second so that
one pack's swap overlaps the other's compute. How many packs a plan has, and where they start,
Harmony's Alg. 2 decides from the layers' time and memory (passes/harmony_plan.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum

from stagewise.ir.choices import Schedule
from stagewise.ir.errors import PartitionError
from stagewise.passes.zb_v import v_device

VIRTUAL_STAGES = 2  # model chunks per device under the interleaved schedule
PER_STAGE = "per-stage"  # replicas=: PipeDream's DP replicates each stage its own way (passes/pipedream_partition.py)


class Grouping(StrEnum):
    """Which instances of a P x D plan sit on consecutive devices (the devices of one host)."""

    PIPELINES = "pipelines"  # each copy of the pipeline: its p2p stays inside, its all-reduces cross
    STAGE_COPIES = "stage-copies"  # each stage's D copies: its all-reduce stays inside, the p2p crosses


@dataclass(frozen=True)
class Layout:
    positions: int  # logical stages (packs)
    replicas: int
    device_of: Callable[[int, int], int]  # (position, replica) -> device
    grouping: Grouping = Grouping.PIPELINES


def choose_layout(schedule: Schedule, n_devices: int, replicas: int, legal_cuts: int, stages: int | None = None,
                  grouping: Grouping = Grouping.PIPELINES) -> Layout:
    """`stages`: the pipeline depth P of gpipe / 1f1b / 2bw / zb-h1 / varuna (default N / D); `grouping`:
    which of their instances share consecutive devices."""
    n, d = n_devices, replicas
    if stages is not None and schedule not in (Schedule.GPIPE, Schedule.ONE_F_ONE_B, Schedule.TWO_BW, Schedule.ZB_H1, Schedule.VARUNA):
        raise PartitionError(f"stages= sets the depth of a gpipe, 1f1b, 2bw, zb-h1 or varuna pipeline; {schedule} places its own")
    if schedule in (Schedule.HARMONY_PP, Schedule.HARMONY_DP):
        if d != 1:
            raise PartitionError(f"{schedule} chooses its own data parallelism; drop replicas={d}")
        per_lane = n if schedule == Schedule.HARMONY_PP else 1
        packs = min(2 * per_lane, legal_cuts + 1)
        if schedule == Schedule.HARMONY_PP:
            return Layout(packs, 1, lambda s, r: s % n)
        return Layout(packs, n, lambda s, r: r)
    if schedule == Schedule.INTERLEAVED:
        if d != 1:
            raise PartitionError("the interleaved schedule runs without data-parallel replicas; drop replicas=")
        return Layout(n * VIRTUAL_STAGES, 1, lambda s, r: s % n)
    if schedule == Schedule.ZB_V:
        return _v_layout(n, d, legal_cuts)
    if n % d:
        raise PartitionError(f"replicas={d} must divide the {n} devices")
    p = n // d if stages is None else stages
    if not 1 <= p <= n // d:
        raise PartitionError(f"stages={stages} with replicas={d} needs {p * d} of the {n} devices; use at most {n // d}")
    if grouping is Grouping.STAGE_COPIES:
        return Layout(p, d, lambda s, r: s * d + r, grouping)
    return Layout(p, d, lambda s, r: r * p + s)


def groupings(schedule: Schedule, replicas: int, depth: int, hosts: Sequence[int]) -> list[Grouping]:
    """How to group a P x D plan's instances, in the order to try: each stage's copies together
    first (Narayanan et al. §3: data parallelism inside a host, the pipeline across hosts), then each
    pipeline copy together, where its devices (the first P x D) span several of `hosts` (the host of
    each device) and it has several stages and copies; else the one way. The simulator, charging each
    all-reduce and send on the link it crosses, decides between them."""
    replicating = schedule in (Schedule.GPIPE, Schedule.ONE_F_ONE_B, Schedule.TWO_BW, Schedule.ZB_H1, Schedule.VARUNA)
    if not replicating or replicas < 2 or depth < 2 or len(set(hosts[:depth * replicas])) < 2:
        return [Grouping.PIPELINES]
    return [Grouping.STAGE_COPIES, Grouping.PIPELINES]


def _v_layout(n: int, replicas: int, legal_cuts: int) -> Layout:
    """ZB-V's 2N stages in a V; refused where the model has too few legal cuts for two stages per device."""
    if replicas != 1:
        raise PartitionError("the zb-v schedule runs without data-parallel replicas; drop replicas=")
    if 2 * n > legal_cuts + 1:
        fewer = (legal_cuts + 1) // 2
        raise PartitionError(
            f"the zb-v schedule runs two stages per device in a V: {2 * n} stages on {n} devices, and the model has "
            f"only {legal_cuts} legal cut-points ({legal_cuts + 1} stages at most); use schedule='zb-h1' (one stage "
            "per device, the same split backward)" + (f", {fewer} devices or fewer" if fewer else "")
            + ", or make the model's blocks finer-grained modules")
    return Layout(2 * n, 1, lambda s, r: v_device(s, n))
