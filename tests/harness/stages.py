"""Hand-made stages for the simulator and the schedules: no model is traced."""

from __future__ import annotations

from stagewise.ir.plan import Stage, Transfer


def chain(p: int) -> tuple[tuple[Stage, ...], tuple[Transfer, ...]]:
    """p stages in a line: stage s gets h{s-1} from s - 1 and sends h{s} to s + 1; the last returns the loss."""
    stages = tuple(
        Stage(
            index=s,
            device=s,
            layers=(s,),
            inputs=("x",) if s == 0 else (f"h{s - 1}",),
            outputs=("loss",) if s == p - 1 else (f"h{s}",),
            params=(f"w{s}",),
            buffers=(),
        )
        for s in range(p)
    )
    transfers = tuple(Transfer(f"h{s}", s, s + 1, 4.0, True) for s in range(p - 1))
    return stages, transfers
