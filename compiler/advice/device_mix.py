"""A candidate device set for `sw.recommend`: one request ("2xp4d.24xlarge") or a mix of several
joined by "+" ("1xp4d.24xlarge+1xg6.xlarge"): its devices, price, links and whose figures.

A mix is heterogeneous: devices of different speed and memory, which the planner's CP-SAT binding
places (stages on the devices that suit them). Links: within an instance its intra-node
bandwidth; between instances the slower of the two instances' network bandwidth, shared by the
devices of an instance. Each instance is a host: its devices' swaps cross their PCIe links to it.
Where the catalogue lacks a link figure the whole set gets sw.plan's default link.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from stagewise.catalogue.entries import Catalogue
from stagewise.catalogue.requests import Cluster, check_device_request, parse_device_request
from stagewise.compiler.compile.modelled_costs import modelled_topology
from stagewise.ir.devices import Device
from stagewise.ir.topology import Topology


@dataclass(frozen=True)
class Mix:
    """The devices of one or more clusters, in request order."""

    clusters: tuple[Cluster, ...]

    @property
    def devices(self) -> list[Device]:
        return [device for cluster in self.clusters for device in cluster.devices]

    @property
    def instances(self) -> int:
        return sum(len(cluster.nodes) for cluster in self.clusters)

    @property
    def usd_per_hour(self) -> float | None:
        """Every instance together; None when any part has no on-demand price."""
        prices = [cluster.instance_type.on_demand if cluster.instance_type is not None else None
                  for cluster in self.clusters]
        if any(price is None for price in prices):
            return None
        return sum(price.usd_per_hour * len(cluster.nodes)
                   for price, cluster in zip(prices, self.clusters, strict=True) if price is not None)

    @property
    def fallback(self) -> str:
        """How a precision is timed on parts without its units ('' when every part has them)."""
        return "; ".join(dict.fromkeys(cluster.fallback for cluster in self.clusters if cluster.fallback))

    @property
    def figures(self) -> str:
        return "measured" if any(cluster.accelerator.measured for cluster in self.clusters) else "datasheet"

    @property
    def hosts(self) -> tuple[int, ...]:
        """Per device, its instance: the host whose memory its swaps cross PCIe to."""
        return tuple(n for n, members in enumerate(m for c in self.clusters for m in c.nodes) for _ in members)

    def topology(self) -> Topology | None:
        """The catalogue's links (`catalogue_topology`); where a figure is missing, sw.plan's default
        link between every pair, still each instance its own host; None for one instance without them."""
        found = self.catalogue_topology()
        if found is not None or self.instances == 1:
            return found
        return replace(modelled_topology(self.devices), hosts=self.hosts)

    def catalogue_topology(self) -> Topology | None:
        """Per pair of devices: their instance's intra-node link, or the slower instance's network
        share; None where a figure the set needs is missing. One instance type keeps its two levels
        (PipeDream's DP partitions level by level)."""
        nodes = [(cluster, members) for cluster in self.clusters for members in cluster.nodes]
        if len(self.devices) == 1:
            return None
        if len(self.clusters) == 1:
            return _levels(self.clusters[0])
        links: list[tuple[float, float]] = []  # per device: its instance's (intra, inter) link
        for cluster, members in nodes:
            intra = cluster.intra_node_bandwidth if len(members) > 1 else float("inf")
            inter = cluster.inter_node_bandwidth / len(members) if cluster.inter_node_bandwidth else None
            if intra is None or inter is None:  # two clusters or more: always several nodes
                return None
            links.extend([(intra, inter)] * len(members))
        node_of = self.hosts
        matrix = Topology.from_matrix([[None if i == j else links[i][0] if node_of[i] == node_of[j]
                                        else min(links[i][1], links[j][1]) for j in range(len(links))]
                                       for i in range(len(links))])
        return replace(matrix, hosts=node_of)


def _levels(cluster: Cluster) -> Topology | None:
    """Instances of one type: within one the intra-node link, across them the network's share."""
    per_node, nodes = len(cluster.nodes[0]), len(cluster.nodes)
    intra, inter = cluster.intra_node_bandwidth, cluster.inter_node_bandwidth
    if per_node > 1 and intra is None:
        return None
    if nodes == 1:  # one device alone has no links: `topology` answers None before asking
        return None if intra is None else Topology.uniform(per_node, intra)
    if inter is None:
        return None
    return Topology.two_level(nodes, per_node, intra if intra is not None and per_node > 1 else inter, inter / per_node)


def check_request(request: str, catalogue: Catalogue) -> None:
    """A DeviceError for a misspelt part (a typo fails the search at once)."""
    for part in request.split("+"):
        check_device_request(part, catalogue)


def mix_of(request: str, catalogue: Catalogue, precision: str) -> Mix:
    """The clusters a request names, "+" joining the parts of a mix."""
    return Mix(tuple(parse_device_request(part, catalogue, precision=precision) for part in request.split("+")))
