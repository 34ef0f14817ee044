"""Logical device meshes and the link each mesh axis crosses.

Sits between ``cluster.py`` (device types, nodes, network) and the search: the intra-op search
(``search/layer/intra_op.py``) shards ops over a :class:`LogicalMesh` of one device type, and prices
every collective on an axis with that axis' :class:`AxisLink` (``search/pricing/cost_model.py``).

Rank layout: ranks fill the mesh with the **last axis fastest** (row-major, ``tp`` innermost),
and nodes hold ``gpus_per_node`` consecutive ranks. So axis ``i`` stays inside a node iff
``prod(shape[i:]) <= gpus_per_node``; the axes inside it (``shape[i+1:]``) then never leave the
node either.

Pricing an axis that spans nodes (the NIC rule). Every device belongs to exactly one group along
axis ``i`` and all groups run their collective at the same time (an SPMD step). Let
``inner = prod(shape[i+1:])``; one group then has ``c = max(1, gpus_per_node // inner)`` members
inside each node it touches, chained by the intra-node link, and its ring enters and leaves that
node once. The node's NIC (``Network.nic_bandwidth`` bytes/s per node, per direction) is therefore
shared by ``gpus_per_node // c`` concurrent rings, and one ring runs at
``min(intra_node_bandwidth, nic_bandwidth / (gpus_per_node // c))``. Examples with 8 GPUs per
node: a (4, 8) mesh's ``dp`` axis has c = 1, eight rings share the NIC, 1/8 of it each; a
(16, 2) mesh's axis 0 has c = 4, two rings per node, 1/2 each. Latency is the network's.
"""

from __future__ import annotations

import dataclasses
import math

from partita.cluster import DeviceType, Network
from partita.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class AxisLink:
    """What one mesh axis' collectives run on: per-ring bandwidth (bytes/s) and per-hop latency."""

    axis: str
    size: int
    bandwidth: float
    latency: float
    crosses_nodes: bool


@dataclasses.dataclass(frozen=True)
class LogicalMesh:
    """An N-d mesh of ``prod(shape)`` devices of one type, ranks laid out last axis fastest."""

    shape: tuple[int, ...]
    axis_names: tuple[str, ...]
    device: DeviceType
    gpus_per_node: int
    network: Network = Network()

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(s) for s in self.shape))
        object.__setattr__(self, "axis_names", tuple(self.axis_names))
        if len(self.shape) != len(self.axis_names) or not self.shape:
            raise ConfigError(
                f"mesh shape {self.shape} and axis names {self.axis_names} differ in length (or are empty).",
                "give one name per mesh axis, e.g. LogicalMesh((2, 4), ('dp', 'tp'), ...).",
            )
        if any(s < 1 for s in self.shape) or len(set(self.axis_names)) != len(self.axis_names):
            raise ConfigError(
                f"mesh shape {self.shape} / names {self.axis_names} invalid.",
                "use positive axis sizes and distinct axis names.",
            )
        if self.gpus_per_node < 1:
            raise ConfigError(f"gpus_per_node={self.gpus_per_node} must be >= 1.", "pass the node size.")
        inner = 1
        for s in reversed(self.shape):  # an axis that straddles nodes must tile them evenly
            outer = inner * s
            if inner < self.gpus_per_node < outer and (self.gpus_per_node % inner or outer % self.gpus_per_node):
                raise ConfigError(
                    f"mesh {self.shape} does not tile nodes of {self.gpus_per_node} devices.",
                    "choose axis sizes whose inner products divide or are multiples of gpus_per_node.",
                )
            inner = outer

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def num_devices(self) -> int:
        return math.prod(self.shape)

    def axis_index(self, name: str) -> int:
        if name not in self.axis_names:
            raise ConfigError(f"mesh has no axis {name!r}.", f"use one of {self.axis_names}.")
        return self.axis_names.index(name)

    def inner_size(self, axis: int) -> int:
        """Number of devices per step along the axes inside ``axis`` (its rank stride)."""
        return math.prod(self.shape[axis + 1 :])

    def is_intra_node(self, axis: int) -> bool:
        return self.shape[axis] * self.inner_size(axis) <= self.gpus_per_node

    def link(self, axis: int) -> AxisLink:
        """The link class of mesh axis ``axis`` (see the module docstring for the NIC rule)."""
        name, size = self.axis_names[axis], self.shape[axis]
        if self.is_intra_node(axis):
            return AxisLink(name, size, self.device.intra_node_bandwidth, self.device.intra_node_latency, False)
        members_per_node = max(1, self.gpus_per_node // self.inner_size(axis))
        rings_per_nic = self.gpus_per_node // members_per_node
        bw = min(self.device.intra_node_bandwidth, self.network.nic_bandwidth / rings_per_nic)
        return AxisLink(name, size, bw, self.network.latency, True)

    def links(self) -> tuple[AxisLink, ...]:
        return tuple(self.link(i) for i in range(self.ndim))

    def default_boundary(self) -> tuple[str, ...]:
        """Layer input/output placement: batch dim sharded on the axis named ``dp``, replicated elsewhere."""
        return tuple("S(0)" if n == "dp" else "R" for n in self.axis_names)

    def describe(self) -> str:
        return "(" + ", ".join(f"{n}={s}" for n, s in zip(self.axis_names, self.shape)) + f") x {self.device.name}"
