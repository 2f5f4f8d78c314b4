"""What a pipeline reports: its plan's parts, the figures of the last step, its timeout, memory
statistics and the simulator's prediction. `Pipeline` (compiler/pipeline/pipeline.py) builds on
it with what a user does: steps, state, checkpoints. This base owns the state it reads.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.fx as fx

from stagewise.compiler.assembly.loss_reduction import LossReduction
from stagewise.compiler.assembly.runtime_setup import Runtime
from stagewise.compiler.assembly.shape_buckets import Padding
from stagewise.compiler.pipeline.step_notices import StepNotices
from stagewise.ir.plan import Plan, SharedTensor
from stagewise.ir.program import Program
from stagewise.passes.costs import plan_charges
from stagewise.passes.simulate import SimCost, SimResult, simulate
from stagewise.runtime.device_time import DeviceTime, device_times, stats_columns
from stagewise.runtime.distributed import DistributedTransport
from stagewise.runtime.executor import DEFAULT_TIMEOUT_S, StreamExecutor
from stagewise.runtime.launch import DistributedContext
from stagewise.runtime.worker import StageWorker


@dataclass(frozen=True)
class Compiled:
    """What compiling found beside the plan (a loaded pipeline has none): the planner's per-stage
    costs of the chosen plan (`pipe._sim_cost`, for benches and tests that vary them), the seconds
    each compile phase took (`pipe.compile_times`), and the loss reduction compile was given."""

    sim_cost: SimCost
    phase_seconds: dict[str, float] = field(default_factory=dict)
    loss_reduction: LossReduction | None = None
    model_graph: dict | None = None  # what checkpoints keep to plan again (compiler/compile/model_graph.py)
    padding: Padding | None = None  # how steps' sequences are padded (compile's shape_buckets)


class PipelineReadings:
    """The read-only side of a `Pipeline` (see its docstring; `pipe` in the examples is one).

    Args:
        plan: the plan the programs come from.
        runtime: its pools, transport, stage workers and executor in this process.
        compiled: what compiling found beside the plan; None for a loaded pipeline.
    """

    def __init__(self, plan: Plan, runtime: Runtime, compiled: Compiled | None = None):
        self.plan = plan
        self._runtime = runtime
        self._sim_cost = compiled.sim_cost if compiled is not None else None
        self._compile_times = dict(compiled.phase_seconds) if compiled is not None else {}
        self._notices = StepNotices()  # warnings given once, skipped updates counted (compiler/pipeline/step_notices.py)
        self.timeout_s = DEFAULT_TIMEOUT_S

    # ---- the runtime's parts ---------------------------------------------------------------
    @property
    def context(self) -> DistributedContext | None:
        """This process's rank and world under torch.distributed; None in one process.

        Example:
            >>> pipe.context is None
            True
        """
        return self._runtime.context

    @property
    def _workers(self) -> list[StageWorker]:
        return self._runtime.workers

    @property
    def _executor(self) -> StreamExecutor:
        return self._runtime.executor

    # ---- the public surface -------------------------------------------------------------
    @property
    def compile_times(self) -> dict[str, float]:
        """Seconds each compile phase took, by phase name (capture ... runtime); {} after `sw.load`.

        Example:
            >>> list(pipe.compile_times)
            ['capture', 'analyse', 'cost', 'plan', 'codegen', 'runtime']
        """
        return dict(self._compile_times)

    @property
    def stages(self) -> list[fx.GraphModule]:
        """The generated stage modules this process runs, one GraphModule each (print one's `.code`).

        Example:
            >>> [type(stage).__name__ for stage in pipe.stages]
            ['Stage0', 'Stage1']
        """
        return [w.module for w in self._workers]

    @property
    def programs(self) -> tuple[Program, ...]:
        """The plan's instruction programs, one per device (print one to read it).

        Example:
            >>> [program.device for program in pipe.programs]
            [0, 1]
        """
        return self.plan.programs

    @property
    def shared(self) -> tuple[SharedTensor, ...]:
        """The tensors several stages hold (tied weights), and how their gradients are summed.

        Example:
            >>> pipe.shared  # the MLP ties no weights
            ()
        """
        return self.plan.shared

    @property
    def loss_scale(self) -> float | None:
        """fp16's current loss scale (runtime/precision.py); None in fp32 and bf16.

        Example:
            >>> pipe.loss_scale is None  # compiled in fp32
            True
        """
        return None if self._executor.state.scaler is None else self._executor.state.scaler.scale

    @property
    def last_step_skipped(self) -> bool:
        """Whether the last step's gradients held an inf or NaN (seen in the global norm, which fp16 and
        clip_grad_norm compute), so no stage updated (fp16: the scale backed off).

        Example:
            >>> _ = pipe.step(x, target=y)
            >>> pipe.last_step_skipped
            False
        """
        return self._executor.state.last_step_skipped

    @property
    def skipped_steps(self) -> int:
        """How many of this pipeline's steps skipped their update so far (the first one warns).

        Example:
            >>> pipe.skipped_steps
            0
        """
        return self._notices.skipped_steps

    @property
    def last_grad_norm(self) -> float | None:
        """The global gradient norm of the last step, before clipping (as clip_grad_norm_ returns
        it); None without clip_grad_norm.

        Example:
            >>> _ = pipe.step(x, target=y)
            >>> pipe.last_grad_norm is None  # compiled without clip_grad_norm
            True
        """
        return self._executor.state.last_grad_norm

    def time_breakdown(self) -> list[DeviceTime]:
        """Where the last step's time went, per device of this process (before the first step, all zero):
        whether the model (compute) or the runtime (dispatch) took it, and what waited.

        Returns:
            One `DeviceTime` per device (runtime/device_time.py), in seconds: the step's wall time split
            on the compute thread into compute, waiting on dependencies, host dispatch, swaps and p2p it ran inline
            and idle (they add up to `step_s`), and the seconds of each swap and p2p stream beside it.
            Each is also readable by name (`row["compute_s"]`).

        Example:
            >>> _ = pipe.step(x, target=y)
            >>> row = pipe.time_breakdown()[0]
            >>> row.device, row.compute_s > 0, row["compute_s"] == row.compute_s
            (0, True, True)
            >>> parts = row.compute_s + row.waiting_s + row.dispatch_s + row.inline_s + row.idle_s
            >>> abs(parts - row.step_s) < 1e-9
            True
        """
        return device_times(self._executor.programs, self._executor.state.step.times)

    @property
    def timeout_s(self) -> float:
        """The step's deadline in seconds (default 300): in one process `step` returns within it (and
        a small margin) whatever a stage does, raising StepTimeoutError naming what stalled. Under
        torch.distributed a device waits this long for a peer before a PeerError naming the rank.

        Example:
            >>> pipe.timeout_s
            300.0
            >>> pipe.timeout_s = 60.0
            >>> pipe.timeout_s
            60.0
            >>> pipe.timeout_s = 300.0
        """
        transport = self._runtime.transport
        return transport.timeout_s if isinstance(transport, DistributedTransport) else self._executor.state.timeout_s

    @timeout_s.setter
    def timeout_s(self, seconds: float) -> None:
        # Across processes the transport's wait names the silent rank: let it expire first.
        transport = self._runtime.transport
        self._executor.state.timeout_s = 2 * seconds if isinstance(transport, DistributedTransport) else seconds
        if isinstance(transport, DistributedTransport):
            transport.timeout_s = seconds

    @property
    def stats(self) -> list[dict[str, int | float | None]]:
        """Per device, from its memory pool: peak and current bytes (by kind), swap and p2p bytes;
        and the last step's seconds from `time_breakdown` (`compute_s`, `waiting_s`, `dispatch_s`,
        ...; None for a device another process runs). (`pipe.stats[0]["peak_bytes"]`: device 0's peak.)

        Example:
            >>> [(row["device"], row["peak_bytes"] > 0) for row in pipe.stats]
            [(0, True), (1, True)]
        """
        times = {row.device: row for row in self.time_breakdown()}
        return [{**pool.stats(), **stats_columns(times.get(pool.index))} for pool in self._runtime.pools]

    def simulate(self, peak_flops: float | None = None, bandwidth: float | None = None) -> SimResult:
        """The predicted timeline of one iteration of these programs, with the costs the plan's
        prediction charged (profiled or analytic; the plan keeps them, so a loaded pipeline predicts
        the same), or for other hardware: devices of `peak_flops` FLOP/s (the analytic model's compute
        bound), links of `bandwidth` bytes/s (passes/costs.py `plan_charges`).

        Args:
            peak_flops: every device's FLOP/s, or None for the plan's own costs.
            bandwidth: every link's bytes/s, or None for the plan's own links.

        Returns:
            The `SimResult`: iteration time, per-device busy and idle time, peak memory, timeline.

        Example:
            >>> result = pipe.simulate()
            >>> result.iteration_time > 0, len(result.peak_bytes)
            (True, 2)
        """
        return simulate(self.plan.programs, plan_charges(self.plan, peak_flops, bandwidth))  # as sw.simulate
