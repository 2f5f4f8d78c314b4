"""Device requests as users write them on a command line: '8xH100', 'p4d.24xlarge', '2xp4d.24xlarge'.

A request names a catalogue accelerator ('COUNTxNAME': COUNT devices, how they are packaged
unknown) or an instance type ('COUNTxTYPE': COUNT whole instances). It becomes the `Device`s the
planner takes, with the figures of the precision it will train in, and the node structure the
instance type implies: which devices share an instance and the bandwidths within and between
instances. This is the cluster a plan is made for; compiler/compile/cluster.py measures the one a job
actually runs on.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from stagewise.catalogue.entries import (
    Accelerator,
    AcceleratorKind,
    Catalogue,
    Dtype,
    InstanceType,
    closest_names,
)
from stagewise.catalogue.files import shipped_catalogue
from stagewise.ir.devices import Device
from stagewise.ir.errors import DeviceError

_REQUEST = re.compile(r"\s*(?:([-+]?[0-9.]+)\s*[xX*×]\s*)?(\S*)\s*")
_EXAMPLES = "'8xH100', 'p4d.24xlarge' or '2xp4d.24xlarge'"


@dataclass(frozen=True)
class Cluster:
    """The devices a request stands for. `nodes[k]` holds the indices (into `devices`) of the
    devices in instance k; device names are local to their instance ('cuda:0'..'cuda:7' in each).
    `intra_node_bandwidth` is bytes/s one device can send to the others of its instance,
    `inter_node_bandwidth` bytes/s one instance can send to another, both one direction; None where
    the catalogue has no figure, and both None for a bare accelerator count (packaging unknown).
    `sw.parse_device_request` builds it; its `devices` are what `sw.plan(devices=)` takes.

    Args:
        accelerator: the catalogue accelerator of every device.
        instance_type: the instance type requested, None for a bare accelerator count.
        precision: the dtype whose peak FLOP/s the devices carry.
        devices: the devices, instance by instance.
        nodes: per instance, the indices of its devices.
        intra_node_bandwidth: bytes/s within an instance, one direction.
        inter_node_bandwidth: bytes/s between instances, one direction.
        fallback: empty, or how the precision is timed on an accelerator without its units
            ('bf16 timed at the fp16 rate ...').

    Example:
        >>> cluster = sw.parse_device_request("2xp4d.24xlarge", precision="bf16")
        >>> len(cluster.devices), cluster.intra_node_bandwidth, cluster.inter_node_bandwidth
        (16, 300000000000.0, 50000000000.0)
    """

    accelerator: Accelerator
    instance_type: InstanceType | None
    precision: Dtype
    devices: tuple[Device, ...]
    nodes: tuple[tuple[int, ...], ...]
    intra_node_bandwidth: float | None
    inter_node_bandwidth: float | None
    fallback: str = ""

    def node_of(self, device: int) -> int:
        """The instance that holds a device.

        Args:
            device: an index into `devices`.

        Returns:
            The index into `nodes` of its instance.

        Raises:
            DeviceError: the index is not a device of the cluster.

        Example:
            >>> sw.parse_device_request("2xp4d.24xlarge").node_of(9)
            1
        """
        for node, members in enumerate(self.nodes):
            if device in members:
                return node
        raise DeviceError(f"device index {device} is not in this cluster of {len(self.devices)} devices; "
                          f"give 0..{len(self.devices) - 1}")


def check_device_request(request: str, catalogue: Catalogue | None = None) -> None:
    """A DeviceError for a request that is misspelt (bad count, unknown name); a known name whose
    figures the precision lacks is left to `parse_device_request` (a candidate out, not a typo)."""
    catalogue = catalogue if catalogue is not None else shipped_catalogue()
    _, name = _split(request)
    if not (catalogue.knows_instance_type(name) or catalogue.knows_accelerator(name)):
        raise DeviceError(_unknown(name, request, catalogue))


def parse_device_request(request: str, catalogue: Catalogue | None = None,
                         precision: Dtype | str = Dtype.FP32) -> Cluster:
    """The cluster a request names, as a command line writes it: devices to plan for without
    describing each (`sw.plan(model, cluster.devices, ...)`).

    Args:
        request: 'COUNTxACCELERATOR' ('8xH100': devices, packaging unknown), 'INSTANCE_TYPE' or
            'COUNTxINSTANCE_TYPE' ('2xp4d.24xlarge': whole instances).
        catalogue: where the names are looked up; None for the shipped catalogue.
        precision: which peak FLOP/s the devices get: 'fp32' the plain fp32 rate (not TF32),
            'tf32', 'bf16' or 'fp16' that dtype's dense tensor-core rate. An accelerator without
            bf16 units (T4, V100) gets its best rate instead, fp16's or else fp32's, and the
            cluster's `fallback` says so.

    Returns:
        The `Cluster`: the devices with the accelerator's figures, and which share an instance.

    Raises:
        DeviceError: a request that does not parse, a name the catalogue lacks (the closest names
            suggested), an unknown precision, or an accelerator without that precision's figure.

    Example:
        >>> cluster = sw.parse_device_request("4xH100", precision="bf16")
        >>> cluster.devices[0].name, cluster.devices[0].memory, cluster.nodes
        ('cuda:0', 80000000000, ((0, 1, 2, 3),))
    """
    catalogue = catalogue if catalogue is not None else shipped_catalogue()
    dtype = _dtype(precision)
    count, name = _split(request)
    if catalogue.knows_instance_type(name):
        instance = catalogue.instance_type(name)
        return _cluster(catalogue.accelerator_of(instance), instance, count, instance.accelerators, dtype)
    if catalogue.knows_accelerator(name):
        return _cluster(catalogue.accelerator(name), None, 1, count, dtype)
    raise DeviceError(_unknown(name, request, catalogue))


def _cluster(accelerator: Accelerator, instance: InstanceType | None, instances: int, per_instance: int,
             dtype: Dtype) -> Cluster:
    timed_as = _timed_as(accelerator, dtype)
    flops = _peak_flops(accelerator, timed_as)
    host_memory = instance.host_memory if instance else None
    devices: list[Device] = []
    nodes = []
    for node in range(instances):
        nodes.append(tuple(range(len(devices), len(devices) + per_instance)))
        devices += [_device(accelerator, flops, local, node, host_memory.value if host_memory else None)
                    for local in range(per_instance)]
    intra = instance.intra_node_bandwidth if instance else None
    inter = instance.inter_node_bandwidth if instance else None
    fallback = "" if timed_as is dtype else \
        f"{dtype.value} timed at the {timed_as.value} rate: {accelerator.name} has no {dtype.value} units"
    return Cluster(accelerator=accelerator, instance_type=instance, precision=dtype, devices=tuple(devices),
                   nodes=tuple(nodes), intra_node_bandwidth=intra.value if intra else None,
                   inter_node_bandwidth=inter.value if inter else None, fallback=fallback)


BF16_FALLBACKS = (Dtype.FP16, Dtype.FP32)  # a bf16 request on a part without bf16 units, best first


def _timed_as(accelerator: Accelerator, dtype: Dtype) -> Dtype:
    """The dtype whose rate a request is timed at: its own where the accelerator lists it; for bf16
    on a part without bf16 units (Turing's T4, Volta's V100) its best supported rate, the fp16
    tensor cores' if it has them, else fp32's (what the part runs a mixed-precision step at)."""
    if dtype is not Dtype.BF16 or accelerator.peak_flops.figure(dtype) is not None:
        return dtype
    return next((d for d in BF16_FALLBACKS if accelerator.peak_flops.figure(d) is not None), dtype)


def _peak_flops(accelerator: Accelerator, dtype: Dtype) -> float | None:
    """The FLOP/s the devices get. A CUDA accelerator must have the precision's figure (the planner
    cannot cost it otherwise); a CPU entry with no FLOP/s at all is this host's CPU, which compile
    measures."""
    figure = accelerator.peak_flops.figure(dtype)
    if figure is not None:
        return figure.value
    listed = accelerator.peak_flops.dtypes()
    if accelerator.kind is AcceleratorKind.CPU and not listed:
        return None
    have = f"it lists {', '.join(d.value for d in listed)}" if listed else "it lists none"
    why = f"; {accelerator.note.rstrip('.')}" if accelerator.note else ""
    raise DeviceError(
        f"the catalogue has no {dtype.value} peak FLOP/s for {accelerator.name} ({have}{why}); choose another "
        f"precision or add the figure in your catalogue file: [accelerators.{accelerator.name}] "
        f"peak_flops.{dtype.value} = {{ value = '...TFLOPS', sources = ['...'] }}")


def _device(accelerator: Accelerator, peak_flops: float | None, local_index: int, node: int,
            host_memory: float | None) -> Device:
    """Device number `local_index` of instance `node`, with the accelerator's figures and the
    instance's RAM (which the devices of one instance share)."""
    name = f"cuda:{local_index}" if accelerator.kind is AcceleratorKind.CUDA else "cpu"
    memory, memory_bw, host_bw = accelerator.memory, accelerator.memory_bandwidth, accelerator.host_bandwidth
    return Device(name, memory=int(memory.value) if memory else None, peak_flops=peak_flops,
                  memory_bandwidth=memory_bw.value if memory_bw else None,
                  host_bandwidth=host_bw.value if host_bw else None,
                  host_memory=int(host_memory) if host_memory else None, host=node)


def _split(request: str) -> tuple[int, str]:
    """'8xH100' -> (8, 'H100'); 'p4d.24xlarge' -> (1, 'p4d.24xlarge')."""
    if not isinstance(request, str):
        raise DeviceError(f"device request {request!r} is a {type(request).__name__}; write it like {_EXAMPLES}")
    match = _REQUEST.fullmatch(request)
    if match is None or not match.group(2):
        raise DeviceError(f"cannot read device request {request!r}; write it like {_EXAMPLES}")
    count_text, name = match.groups()
    if count_text is None:
        return 1, name
    if not count_text.lstrip("+").isdigit() or int(count_text) < 1:
        raise DeviceError(f"device request {request!r}: the count {count_text!r} must be a whole number of at "
                          f"least 1, as in {_EXAMPLES}")
    return int(count_text), name


def _dtype(precision: Dtype | str) -> Dtype:
    try:
        return Dtype(precision)
    except ValueError:
        raise DeviceError(f"unknown precision {precision!r} for peak FLOP/s; choose one of "
                          f"{', '.join(repr(d.value) for d in Dtype)}") from None


def _unknown(name: str, request: str, catalogue: Catalogue) -> str:
    aliases = [alias for acc in catalogue.accelerators for alias in acc.aliases]
    names = catalogue.accelerator_names() + catalogue.instance_type_names() + aliases
    close = closest_names(name, names)
    hint = f"did you mean {' or '.join(map(repr, close))}? " if close else ""
    return (f"device request {request!r}: {name!r} is neither an accelerator nor an instance type of the "
            f"catalogue; {hint}accelerators: {', '.join(catalogue.accelerator_names())}; instance types: "
            f"{', '.join(catalogue.instance_type_names())}. Add your own with sw.load_catalogue('my_devices.toml')")
