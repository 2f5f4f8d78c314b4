"""The layout options (schedule, `stages=`, `replicas=`, `split_points`, `microbatches=`) judged against
the device count before the model is traced: the contradictions the planner would find after torch.export (a
second or more later) raised at once, by the planner's own functions, as if every cut were legal.
What depends on the graph (too few legal cuts, a split point's name) is still found after the trace.
"""

from __future__ import annotations

from collections.abc import Sequence

from stagewise.ir.choices import Schedule
from stagewise.ir.errors import BatchSizeError, PartitionError
from stagewise.passes.layout import choose_layout
from stagewise.passes.pipedream_partition import check_replicated_schedule, consecutive_devices

EVERY_CUT = 1 << 30  # legal cut-points assumed before the trace: only the options are judged


def check_layout_options(schedule: Schedule, replicas: object, stages: object, split_points: Sequence[str] | None,
                         n_devices: int, microbatches: int | None = None) -> None:
    """PartitionError for a layout no graph could give these devices (the checks `choose_layout`,
    `check_replicated_schedule`, `consecutive_devices` and `check_stage_count` make after the trace),
    BatchSizeError for replicas the microbatches asked for cannot share (`check_replica_shares`)."""
    if isinstance(replicas, tuple):
        if schedule is not Schedule.AUTO:
            check_replicated_schedule(schedule)
        if split_points is not None:
            check_stage_count(len(split_points) + 1, replicas)
        consecutive_devices(replicas, n_devices)
    elif schedule is not Schedule.AUTO and isinstance(replicas, int) and (stages is None or isinstance(stages, int)):
        choose_layout(schedule, n_devices, replicas, EVERY_CUT, stages)
    if microbatches is not None:
        check_replica_shares(replicas, microbatches)


def check_stage_count(stages: int, replicas: tuple[int, ...]) -> None:
    """One replica count per stage of the split points."""
    if stages != len(replicas):
        raise PartitionError(f"split_points gives {stages} stages but replicas={replicas} replicates "
                             f"{len(replicas)}; give one count per stage")


def check_replica_shares(replicas: object, microbatches: int) -> None:
    """Every replica gets a share of the microbatches: D whole pipelines an equal one (passes/replicate.py
    `replicate`), a stage replicated its own number of ways at least one each (`replicate_stages`)."""
    if isinstance(replicas, int) and replicas > 1 and microbatches % replicas:
        raise BatchSizeError(f"{replicas} data-parallel replicas need microbatches divisible by {replicas}, got "
                             f"{microbatches}; use a multiple of {replicas} microbatches or fewer replicas")
    if isinstance(replicas, tuple) and replicas and max(replicas) > microbatches:
        stage = replicas.index(max(replicas))
        raise BatchSizeError(f"stage {stage} has {replicas[stage]} replicas but there are only {microbatches} "
                             "microbatches: each replica needs at least one; use more microbatches or fewer replicas")
