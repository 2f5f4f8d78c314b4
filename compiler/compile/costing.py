"""What the planner weighs candidate plans by: per-layer costs at any microbatch size (profiled on
this machine or analytic), what the runtime adds here, the links between the devices, and the optimizer's
state per weight byte."""

from __future__ import annotations

import functools
import sys
from collections.abc import Sequence
from dataclasses import dataclass, replace

from stagewise.compiler.assembly.options import CompileRequest
from stagewise.compiler.compile.analysis import Analysis
from stagewise.compiler.compile.calibrate import (
    calibrate,
    handoff_seconds,
    local_topology,
    optimizer_cost,
    optimizer_state_ratio,
)
from stagewise.compiler.compile.cluster import cluster_topology
from stagewise.compiler.compile.modelled_costs import (
    modelled_host_links,
    modelled_runtime_costs,
    modelled_topology,
)
from stagewise.compiler.compile.split_backward_cost import split_backward_seconds
from stagewise.ir.choices import CostModel, Schedule
from stagewise.ir.costs import RuntimeCosts, training_state_per_param_byte
from stagewise.ir.devices import Device
from stagewise.ir.plan import LayerCost
from stagewise.ir.topology import Topology
from stagewise.passes.analytic import analytic_layers
from stagewise.passes.contention import host_contention
from stagewise.passes.profile import LayerProfile, costs_at, profile_layers
from stagewise.passes.profile_sizes import MAX_MICROBATCH


class LayerCostModel:
    """Per-layer costs at a microbatch size, from one profile (or analytic model) of the first graph."""

    def __init__(self, cost_model: CostModel, analysis: Analysis, device: Device, optimizer_ratio: float,
                 precision: str = "fp32", largest: int = MAX_MICROBATCH, compiled: bool = False):
        self.cost_model, self.analysis, self.device, self.optimizer_ratio = cost_model, analysis, device, optimizer_ratio
        self.precision = precision  # layers are costed under its autocast
        self.compiled = compiled  # compile_stages: profiled times scaled to the layers compiled
        self.largest = largest  # the largest microbatch the planner may choose: the profiler probes no larger

    @functools.cached_property
    def profiles(self) -> list[LayerProfile]:
        first = self.analysis.first
        if self.cost_model == CostModel.ANALYTIC:
            return analytic_layers(first.graph, first.layers, first.microbatch_size, self.device,
                                   optimizer_state_factor=self.optimizer_ratio, precision=self.precision)
        return profile_layers(first.graph, first.layers, self.device, traced_microbatch=first.microbatch_size,
                              quiet=not sys.stderr.isatty(), optimizer_state_factor=self.optimizer_ratio,
                              # several sizes matter only to a planner that weighs several counts; a static
                              # export would be exported again for each
                              graph_at=self.analysis.graph_at_size if self.analysis.dynamic else None,
                              precision=self.precision, max_microbatch=self.largest, compiled=self.compiled)

    def at(self, microbatch_size: int) -> list[LayerCost]:
        return costs_at(self.profiles, microbatch_size)


@dataclass(frozen=True)
class Costs:
    """What the cost phase measured, for every candidate plan alike."""

    layers: LayerCostModel
    runtime: RuntimeCosts
    topology: Topology  # bytes/s of a send between every pair of the devices, and of each one's host link
    optimizer_ratio: float  # bytes of optimizer state per weight byte on the devices
    host_optimizer_ratio: float = 0.0  # the same in host memory, where the optimizer steps on the host

    @property
    def state_ratio(self) -> float:
        """Weights + gradients + optimizer state, per weight byte, on the devices."""
        return training_state_per_param_byte(self.optimizer_ratio)


def measure_costs(request: CompileRequest, analysis: Analysis) -> Costs:
    """Measure the links between the devices (under torch.distributed, with a level per host), profile
    (or model) every layer at the first size, and measure what the runtime adds on this machine. A
    plan that will not run here (sw.plan) models the links and the runtime from the devices' figures
    (compiler/compile/modelled_costs.py) unless `topology=` gives the links."""
    devices = request.devices
    options = request.options
    # no optimizer state on the devices when the optimizer steps on the host: it is in host memory
    state_ratio = optimizer_state_ratio(options.optimizer)
    optimizer_ratio, host_ratio = (0.0, state_ratio) if options.optimizer_on_host else (state_ratio, 0.0)
    largest = MAX_MICROBATCH if options.microbatch_sizes is None else options.microbatch_sizes[1]
    layers = LayerCostModel(options.cost, analysis, devices[0], optimizer_ratio, options.precision, largest,
                            options.acceleration.compile_stages)
    layers.at(analysis.first.microbatch_size)
    if not request.runs_here:
        topology = with_host_links(options.topology or modelled_topology(devices), modelled_host_links(devices))
        return Costs(layers, modelled_runtime_costs(request, analysis), topology, optimizer_ratio, host_ratio)
    context = request.distributed
    topology = options.topology or (local_topology(devices) if context is None
                                    else cluster_topology(devices, context.local_rank, options.tensor_parallel))
    host_links = [float(d.spec().host_bandwidth or calibrate(d).host_bandwidth) for d in devices]
    return Costs(layers, runtime_costs(request, analysis, layers), with_host_links(topology, host_links),
                 optimizer_ratio, host_ratio)


def with_host_links(topology: Topology, host_links: Sequence[float]) -> Topology:
    """The topology with each device's host link, what its swaps cross; one that has its own (a
    user's `topology=`) keeps them."""
    return topology if topology.host_links else replace(topology, host_links=tuple(host_links))


def runtime_costs(request: CompileRequest, analysis: Analysis, layer_costs: LayerCostModel) -> RuntimeCosts:
    """What the runtime adds on this machine: per-instruction hand-offs, contention between the
    in-process CPU devices (measured on the model's costliest layer kind with cost="profile", the
    cores' share with cost="analytic"), the optimizer step, timed on the first device, with the
    undo record the runtime takes before it, and on a CPU what splitting each layer's backward adds."""
    first = analysis.first
    sharing = request.sharing_cpu_devices
    optimizer = request.options.optimizer
    concurrency: tuple[float, ...] = ()
    update_concurrency: tuple[float, ...] = ()
    wake_s = 0.0
    if sharing > 1 and request.options.cost == CostModel.PROFILE:
        measured = host_contention(first.graph, first.layers, layer_costs.at(first.microbatch_size),
                                   first.microbatch_size, sharing, optimizer)
        concurrency, wake_s, update_concurrency = measured.speeds, measured.wake_s, measured.update_speeds
    elif sharing > 1:
        concurrency = tuple(min(1.0, request.cores_at_full_speed / k) for k in range(1, sharing + 1))
    step = optimizer_cost(optimizer, request.devices[0])
    update = tuple(step.seconds(len(params), sum(p.numel() * p.element_size() for p in params)) + record
                   for params, record in zip(analysis.trainable_per_layer(), undo_record_seconds(request, analysis),
                                             strict=True))
    split: tuple[float, ...] = ()
    if may_split_backward(request):
        split = split_backward_seconds(first.graph, first.layers, first.microbatch_size)
    return RuntimeCosts(instruction_s=handoff_seconds(), concurrency=concurrency, update_s=update, wake_s=wake_s,
                        update_concurrency=update_concurrency, split_backward_s=split)


SPLITTING = (Schedule.AUTO, Schedule.ZB_H1, Schedule.ZB_V)  # schedules whose plans may split a backward


def may_split_backward(request: CompileRequest) -> bool:
    """Whether a plan may split a backward whose Python adds to the compute: a zero-bubble schedule, or
    auto weighing one, of several devices the first of which is a CPU (a GPU's host issues the split
    ahead of the device), each stage run eagerly (compiled or graphed stages run their backward whole)."""
    options = request.options
    eager = not (options.acceleration.compile_stages or options.acceleration.cuda_graphs)
    return (options.schedule in SPLITTING and len(request.devices) > 1 and eager
            and request.devices[0].torch_device.type == "cpu")


def undo_record_seconds(request: CompileRequest, analysis: Analysis) -> tuple[float, ...]:
    """Per layer, the seconds of the undo record the runtime takes right before each update so that a
    failed step can be rolled back (runtime/undo.py `UpdateUndo`): the weights and the optimizer
    state copied to host memory, at the first device's host-link bandwidth. Uncharged, it was most of
    the gap between a CPU update's charge and its measured time (bench/simulator_accuracy.py), and on
    a GPU it is a device-to-host copy of all training state but the gradients every step."""
    state_ratio = optimizer_state_ratio(request.options.optimizer)
    bandwidth = calibrate(request.devices[0]).host_bandwidth
    first = analysis.first
    return tuple(
        sum(p.numel() * p.element_size() * (1 + state_ratio if p.requires_grad else 1)
            for p in map(first.graph.get_parameter, layer.params)) / bandwidth
        for layer in first.layers)
