"""What the runtime and the links cost on devices that are not here: modelled from their figures.

`sw.plan` plans for hardware the planning machine need not have (8 GPUs from a laptop), so nothing
it charges may be timed here: a CPU's optimizer step or thread hand-off says nothing about a GPU's.
Layers are costed by passes/analytic.py; this module models the rest:

- the optimizer update of a layer: its state streamed once through the device's memory, a roofline
  (`UPDATE_TRAFFIC`: SGD reads a weight and its gradient and writes the weight, 3 weight-sized
  passes; each tensor of optimizer state per weight adds a read and a write), plus a fixed
  `KERNEL_S` per parameter tensor for the launches; with the optimizer on the host, the same
  traffic through the host's memory at `HOST_UPDATE_BANDWIDTH` (the device's rate charged a 1.3 B
  GPT's host AdamW 0.1 s where FSDP2's measured 1.79 s);
- a per-instruction overhead `INSTRUCTION_S` (the runtime's hand-off between its stream threads
  and a kernel launch; measured here at 20-60 µs per hand-off for in-process CPU devices);
- the links: `topology=` when given, else every pair of devices over `DEFAULT_LINK_BANDWIDTH` of
  their kind (PCIe 4.0 x16 for GPUs: a GPU server without NVLink);
- each device's host link, which its swaps cross: its `host_bandwidth` (the catalogue's PCIe figure
  for a catalogue device), else `DEFAULT_LINK_BANDWIDTH` of its kind.
"""

from __future__ import annotations

from stagewise.compiler.assembly.options import CompileRequest
from stagewise.compiler.compile.analysis import Analysis
from stagewise.compiler.compile.calibrate import optimizer_state_ratio
from stagewise.ir.costs import RuntimeCosts
from stagewise.ir.devices import Device
from stagewise.ir.topology import Topology
from stagewise.passes.analytic import device_rates

INSTRUCTION_S = 30e-6
KERNEL_S = 5e-6  # one kernel launch of an optimizer step, per parameter tensor
DEFAULT_LINK_BANDWIDTH = {"cuda": 25e9, "cpu": 10e9}  # bytes/s: PCIe 4.0 x16 after overheads; a host's memcpy
# bytes/s of update traffic a host optimizer streams: torch's AdamW over FSDP2's CPU shards on the H200
# machine's 16 cores stepped 1.276 B fp32 parameters (7 x 5.1 GB of traffic) in 1.79 s (bench/memory_bound.py)
HOST_UPDATE_BANDWIDTH = 20e9


def update_traffic(optimizer_ratio: float) -> float:
    """Bytes an update moves per weight byte: SGD 3 (read weight and gradient, write the weight),
    each optimizer-state byte per weight byte 2 more (read and written): Adam 7."""
    return 3.0 + 2.0 * optimizer_ratio


def modelled_topology(devices: list[Device]) -> Topology:
    """Every pair of devices joined by the slowest default link of their kinds."""
    slowest = min(DEFAULT_LINK_BANDWIDTH.get(d.torch_device.type, DEFAULT_LINK_BANDWIDTH["cpu"]) for d in devices)
    return Topology.uniform(len(devices), slowest)


def modelled_host_links(devices: list[Device]) -> tuple[float, ...]:
    """Each device's host link: its own figure, else the default of its kind."""
    return tuple(float(spec.host_bandwidth) if spec.host_bandwidth else
                 DEFAULT_LINK_BANDWIDTH.get(spec.kind, DEFAULT_LINK_BANDWIDTH["cpu"])
                 for spec in (d.spec() for d in devices))


def modelled_runtime_costs(request: CompileRequest, analysis: Analysis) -> RuntimeCosts:
    """Per-layer update seconds on the first device's memory bandwidth, or the host's where the
    optimizer steps there (the planner scales them by each device's relative speed), a modelled
    instruction overhead, no CPU contention."""
    _, bandwidth = device_rates(request.devices[0].spec())
    if request.options.optimizer_on_host:
        bandwidth = HOST_UPDATE_BANDWIDTH
    ratio = optimizer_state_ratio(request.options.optimizer)
    update = tuple(len(params) * KERNEL_S + sum(p.numel() * p.element_size() for p in params)
                   * update_traffic(ratio) / bandwidth for params in analysis.trainable_per_layer())
    return RuntimeCosts(instruction_s=INSTRUCTION_S, concurrency=(), update_s=update, wake_s=0.0,
                        update_concurrency=())
