"""Device requests on the command line ('8xH100', 'p4d.24xlarge', mixes '4xH100,2xg6.xlarge' or
'4xH100+2xg6.xlarge') as the devices and links `sw.plan` takes: the same mix `sw.recommend` weighs
(compiler/advice/device_mix.py), so a planned candidate gets the links it was ranked with."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import stagewise as sw
from stagewise.compiler.advice.device_mix import mix_of


@dataclass(frozen=True)
class RequestedDevices:
    """The devices of every request in turn, and their links where the catalogue knows them."""

    request: str  # the parts joined by "+", as sw.recommend writes a mix
    devices: tuple[sw.Device, ...]
    topology: sw.Topology | None
    figures: str  # "measured" (sw.probe_accelerator, or the user's) or "datasheet"
    catalogue_links: bool = False  # the topology's links are the catalogue's, not sw.plan's default

    def describe(self) -> str:
        """One line on the devices, whose figures, and the links the plan assumes, so a default is not
        taken for a figure."""
        devices = f"devices: {self.request} ({len(self.devices)}, {self.figures} figures)"
        if self.topology is not None and self.catalogue_links:
            speeds = ", ".join(f"{b / 1e9:g} GB/s" for b in sorted(set(self.topology.links().values()), reverse=True))
            return f"{devices}; links: {speeds} (the catalogue's)"
        if len(self.devices) == 1:
            return devices
        return (f"{devices}; links: sw.plan's default per device kind, as the catalogue has no figure for some "
                "of them (an instance type such as p5.48xlarge has its links; a count such as 8xH100 has none)")


def requested_devices(requests: Sequence[str], catalogue: sw.Catalogue, precision: str) -> RequestedDevices:
    """Every request parsed as one mix (each device at the precision's peak FLOP/s)."""
    request = "+".join(requests)
    mix = mix_of(request, catalogue, precision)
    return RequestedDevices(request, tuple(mix.devices), mix.topology(), mix.figures,
                            catalogue_links=mix.catalogue_topology() is not None)
