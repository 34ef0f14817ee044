"""Cluster specs: device types, nodes, links. Bottom layer, no framework imports.

A cluster is a list of node groups; each group is ``num_nodes`` nodes of one device type with
``gpus_per_node`` devices joined by an intra-node link (NVLink, PCIe, or shared memory for CPU
ranks) and its own :class:`Network` (all compute NICs of a node together). Every preset device
type has a :data:`REFERENCE_NODES` entry (DGX A100: 8 x 200 Gb/s; DGX H100/H200: 8 x 400 Gb/s;
DGX-1 V100: 4 x 100 Gb/s; cloud L4/T4 nodes: 1 x 100 Gb/s) that shorthand clusters get. The link
between two node groups is the slower side unless ``links`` says otherwise; a collective that spans
nodes is priced at the slowest link it crosses (``search/pricing/mesh.py``, ``search/pricing/cost_model.py``).

Three ways to name a cluster (:func:`parse_cluster`):

* shorthand ``16xA100-80G+8xV100-32G`` (the reference node's devices per node unless
  ``gpus_per_node`` is given, and its network);
* a preset name from :data:`CLUSTER_PRESETS`;
* a YAML or JSON file, see ``docs`` in the README::

    name: lab
    network: {nic_gbps: 200, num_nics: 8, latency_us: 5}   # optional: every group's default
    nodes:
      - {device: A100-80G, num_nodes: 2, gpus_per_node: 8}
      - {device: L4, num_nodes: 1, gpus_per_node: 8, intra_node_GBps: 32, network: {nic_gbps: 50}}
    links:                   # optional: between two groups (index or device type); default the slower side
      - {between: [A100-80G, L4], nic_gbps: 25, num_nics: 1, latency_us: 20}
    device_types:            # optional: types not in the presets
      - {name: MI250, peak_tflops: {bf16: 362}, memory_GB: 64, hbm_GBps: 3277}

Shipped calibration (:data:`SHIPPED_PROFILES`, ``partita/data``) is applied to the preset device
types that have one (A100, H100, H200) unless turned off (``calibrated=False``, ``PARTITA_CALIBRATION=off``,
``partita ... --no-calibration``, or ``profile: none`` on a node group); the plan's cluster record
names it per group (``calibration``).

A node group or device type may name a calibration profile (``profile: PATH``, written by
``partita profile``): :func:`apply_profile` validates it and applies its absolute
``device_overrides`` (peaks, bandwidths, latency) to the device type, so every consumer of the
cluster sees the calibrated device; the cost model reads the profile's ``efficiency`` block
(``search/cost_model.CostModel.for_device``). ``DeviceType.profile_hash`` is the profile's
planning-relevant content hash: the cluster fingerprint (recorded in every plan) changes with it.

Ranks are numbered group by group, node by node, device by device (the torchrun order).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from partita.errors import ClusterSpecError

# Calibration profile format (``partita profile``); ``search/pricing/cost_model.py`` re-exports these.
PROFILE_FORMAT = "partita.efficiency"
PROFILE_VERSION = 1
PROFILE_OVERRIDES = ("peak_flops", "hbm_bandwidth", "intra_node_bandwidth", "intra_node_latency")
_PROFILE_PLANNING_KEYS = (
    "format",
    "version",
    "device",
    "efficiency",
    "device_overrides",
    "profiler_version",
    "stage",
    "applies_to",
)
_PROFILE_LATER_KEYS = ("stage", "applies_to")  # hashed only when present: older profiles keep their hash


class ProfileError(ClusterSpecError):
    """A calibration profile is missing, malformed, from another version, or for another device type."""


GB = 1e9
GiB = 2**30


@dataclasses.dataclass(frozen=True)
class DeviceType:
    """One accelerator model. Peak numbers are dense, per device, in FLOP/s and bytes/s."""

    name: str
    peak_flops: Mapping[str, float]  # dtype -> FLOP/s ("bf16", "f16", "f32")
    memory_bytes: float
    hbm_bandwidth: float
    intra_node_bandwidth: float  # per-device bandwidth into the node fabric (NVLink), bytes/s
    intra_node_latency: float = 2e-6  # seconds
    kind: str = "gpu"  # "gpu" or "cpu"; decides the runtime backend (nccl / gloo)
    profile: str = ""  # path of a calibration profile (``partita profile``), "" for defaults
    profile_hash: str = ""  # content hash of that profile's planning numbers (apply_profile)

    def flops(self, dtype: str) -> float:
        if dtype in self.peak_flops:
            return float(self.peak_flops[dtype])
        if dtype in ("bf16", "f16") and ("bf16" in self.peak_flops or "f16" in self.peak_flops):
            return float(self.peak_flops.get("bf16", self.peak_flops.get("f16", 0.0)))
        return float(self.peak_flops.get("f32", min(self.peak_flops.values())))


def _gpu(
    name: str, tflops_bf16: float, tflops_f32: float, mem_gb: float, hbm_tbs: float, link_gbs: float, half: str = "bf16"
) -> DeviceType:
    peak = {half: tflops_bf16 * 1e12, "f32": tflops_f32 * 1e12}
    if half == "f16":
        peak["bf16"] = tflops_f32 * 1e12  # V100/T4 have no bf16 tensor cores: bf16 runs at fp32 rate
    return DeviceType(name, peak, mem_gb * GB, hbm_tbs * 1e12, link_gbs * GB)


# Published dense peaks (the brief's reference numbers); f32 is the non-tensor-core rate.
DEVICE_PRESETS: dict[str, DeviceType] = {
    d.name: d
    for d in (
        _gpu("H200", 989, 67, 141, 4.8, 900),
        _gpu("H100-80G", 989, 67, 80, 3.35, 900),
        _gpu("A100-80G", 312, 19.5, 80, 2.039, 600),
        _gpu("A100-40G", 312, 19.5, 40, 1.555, 600),
        _gpu("V100-32G", 125, 15.7, 32, 0.9, 300, half="f16"),
        _gpu("V100-16G", 125, 15.7, 16, 0.9, 300, half="f16"),
        _gpu("L4", 121, 30.3, 24, 0.3, 32),  # no NVLink: PCIe 4.0 x16 ~ 32 GB/s
        _gpu("T4", 65, 8.1, 16, 0.32, 16, half="f16"),  # PCIe 3.0 x16
        # A CPU "device" is one gloo rank on this machine, for local end-to-end runs and tests.
        DeviceType("CPU", {"f32": 20e9, "bf16": 5e9}, 4 * GiB, 10e9, 2e9, 20e-6, kind="cpu"),
    )
}
ALIASES = {"H100": "H100-80G", "A100": "A100-80G", "V100": "V100-32G"}


@dataclasses.dataclass(frozen=True)
class ReferenceNode:
    """The node a device type usually ships in: what a shorthand cluster (``64xH100-80G``) assumes."""

    gpus_per_node: int
    num_nics: int  # compute-fabric NICs per node (storage / management NICs not counted)
    nic_gbps: float  # line rate of one NIC, Gb/s per direction
    latency_us: float = 5.0  # one network hop (InfiniBand ~ 5 us; cloud Ethernet more)

    def network(self) -> Network:
        return Network(self.num_nics * self.nic_gbps * 1e9 / 8, self.latency_us / 1e6, self.num_nics)


# Sources: NVIDIA DGX H100 / H200 user guides (8 x ConnectX-7 400 Gb/s NDR compute ports);
# DGX A100 datasheet (8 x ConnectX-6 200 Gb/s HDR compute ports); DGX-1 with V100 datasheet
# (4 x 100 Gb/s EDR InfiniBand); cloud L4 / T4 nodes: GCP g2-standard-96 (8 x L4, 100 Gb/s) and
# AWS g4dn.metal (8 x T4, 100 Gb/s Ethernet/EFA), one NIC each.
REFERENCE_NODES: dict[str, ReferenceNode] = {
    "H200": ReferenceNode(8, 8, 400),
    "H100-80G": ReferenceNode(8, 8, 400),
    "A100-80G": ReferenceNode(8, 8, 200),
    "A100-40G": ReferenceNode(8, 8, 200),
    "V100-32G": ReferenceNode(8, 4, 100),
    "V100-16G": ReferenceNode(8, 4, 100),
    "L4": ReferenceNode(8, 1, 100, 10.0),
    "T4": ReferenceNode(8, 1, 100, 10.0),
}

# Calibration profiles shipped in ``partita/data`` and applied by default to these device types
# (``device_type(..., calibrated=True)``); ``PARTITA_CALIBRATION=off``, ``--no-calibration`` or a
# node's ``profile: none`` turns them off. The A100 profile was fitted on measured Megatron-LM runs
# on A100-80G (``bench/costmodel_accuracy.py``); A100-40G is the same chip with less HBM. The H100 profile
# was fitted on published H100 runs (``bench/h100_calibration.py``, judged by ``bench/published.py``'s
# leave-one-source-out); H200 is the same die (132 SMs, the same dense peak) with more and faster HBM.
SHIPPED_PREFIX = "partita:"
SHIPPED_PROFILES: dict[str, str] = {
    "A100-80G": SHIPPED_PREFIX + "a100_megatron_calibration.json",
    "A100-40G": SHIPPED_PREFIX + "a100_megatron_calibration.json",
    "H100-80G": SHIPPED_PREFIX + "h100_calibration.json",
    "H200": SHIPPED_PREFIX + "h100_calibration.json",
}
DATA_DIR = Path(__file__).parent / "data"


def calibration_default() -> bool:
    """Whether shipped calibration profiles apply (``PARTITA_CALIBRATION=off`` turns them off)."""
    return os.environ.get("PARTITA_CALIBRATION", "on").strip().lower() not in ("off", "0", "false", "no", "none")


def profile_path(profile: str | Path) -> Path:
    """A profile's file: ``partita:NAME`` is a profile shipped in ``partita/data``."""
    s = str(profile)
    return DATA_DIR / s[len(SHIPPED_PREFIX) :] if s.startswith(SHIPPED_PREFIX) else Path(s)


DEVICE_KINDS = ("gpu", "cpu")  # gpu -> nccl, cpu -> gloo


@dataclasses.dataclass(frozen=True)
class Network:
    """A node's way out: ``nic_bandwidth`` is all its compute NICs together, bytes/s per direction."""

    nic_bandwidth: float = 200e9 / 8  # bytes/s per node (one 200 Gb/s NIC when nothing else is known)
    latency: float = 5e-6
    num_nics: int = 1

    def describe(self) -> str:
        per = self.nic_bandwidth * 8 / 1e9 / self.num_nics
        nics = f"{self.num_nics} x {per:g} Gb/s" if self.num_nics > 1 else f"{per:g} Gb/s"
        return f"{nics} per node, {self.latency * 1e6:g} us"

    def slower(self, other: Network) -> Network:
        """The slower of two networks (lower bandwidth, the higher latency of the two)."""
        low = self if self.nic_bandwidth <= other.nic_bandwidth else other
        return dataclasses.replace(low, latency=max(self.latency, other.latency))


UNSET = Network(nic_bandwidth=-1.0)  # "not given": NodeGroup / Cluster fill it in


def reference_network(device: DeviceType) -> Network:
    """The preset network of ``device``'s reference node, ``Network()`` for unknown / CPU devices."""
    ref = REFERENCE_NODES.get(device.name)
    return ref.network() if ref else Network()


@dataclasses.dataclass(frozen=True)
class NodeGroup:
    device: DeviceType
    num_nodes: int
    gpus_per_node: int
    network: Network = UNSET  # UNSET: the cluster's network (filled in by ``Cluster``)

    @property
    def num_devices(self) -> int:
        return self.num_nodes * self.gpus_per_node


@dataclasses.dataclass(frozen=True)
class GroupLink:
    """The network between node groups ``a`` and ``b`` (indices into ``Cluster.groups``)."""

    a: int
    b: int
    network: Network


@dataclasses.dataclass(frozen=True)
class Cluster:
    """Node groups, each with its own network; ``network`` fills groups that name none, and
    ``links`` give the network between two groups (default: the slower of the two sides).

    ``network`` defaults to the slowest group network: code that prices one network for the whole
    cluster stays conservative; :meth:`network_for` / :meth:`link_between` are the precise views.
    """

    name: str
    groups: tuple[NodeGroup, ...]
    network: Network = UNSET
    links: tuple[GroupLink, ...] = ()

    def __post_init__(self) -> None:
        given = self.network is not UNSET
        groups = tuple(
            g
            if g.network is not UNSET
            else dataclasses.replace(g, network=self.network if given else reference_network(g.device))
            for g in self.groups
        )
        object.__setattr__(self, "groups", groups)
        if not given:
            slow = groups[0].network if groups else Network()
            for g in groups[1:]:
                slow = slow.slower(g.network)
            object.__setattr__(self, "network", slow)
        total = sum(g.num_nodes * g.gpus_per_node for g in groups)
        if total > MAX_DEVICES:
            raise ClusterSpecError(
                f"cluster {self.name!r} has {total:,} devices, more than the {MAX_DEVICES:,} Partita plans for.",
                "check the counts (a typo?); plan a smaller cluster.",
            )
        for lk in self.links:
            if not (0 <= lk.a < len(groups) and 0 <= lk.b < len(groups)) or lk.a == lk.b:
                raise ClusterSpecError(
                    f"link between node groups {lk.a} and {lk.b} names no pair of distinct groups.",
                    f"use group indices 0..{len(groups) - 1} (or device names) for two different groups.",
                )

    def group_network(self, index: int) -> Network:
        return self.groups[index].network

    def network_for(self, device_name: str) -> Network:
        """The network of the node groups of one device type (the slowest if several)."""
        nets = [self.group_network(i) for i, g in enumerate(self.groups) if g.device.name == device_name]
        if not nets:
            return self.network
        out = nets[0]
        for n in nets[1:]:
            out = out.slower(n)
        return out

    def link_between(self, a: int, b: int) -> Network:
        """Network between node groups ``a`` and ``b``: the spec's link, else the slower side."""
        if a == b:
            return self.group_network(a)
        for lk in self.links:
            if {lk.a, lk.b} == {a, b}:
                return lk.network
        return self.group_network(a).slower(self.group_network(b))

    def network_among(self, device_names: list[str] | tuple[str, ...]) -> Network:
        """The slowest network a collective over these device types crosses (group links included)."""
        idx = [i for i, g in enumerate(self.groups) if g.device.name in set(device_names)]
        if not idx:
            return self.network
        out = self.group_network(idx[0])
        for i in idx:
            for j in idx:
                out = out.slower(self.link_between(i, j))
        return out

    @property
    def num_devices(self) -> int:
        return sum(g.num_devices for g in self.groups)

    def device_types(self) -> list[DeviceType]:
        seen: dict[str, DeviceType] = {}
        for g in self.groups:
            seen.setdefault(g.device.name, g.device)
        return list(seen.values())

    def count(self, device_name: str) -> int:
        return sum(g.num_devices for g in self.groups if g.device.name == device_name)

    def gpus_per_node(self, device_name: str) -> int:
        return max(g.gpus_per_node for g in self.groups if g.device.name == device_name)

    def ranks(self) -> list[tuple[int, str, int]]:
        """``(rank, device type, node index)`` for every device, in launch order."""
        out, rank, node = [], 0, 0
        for g in self.groups:
            for _ in range(g.num_nodes):
                for _ in range(g.gpus_per_node):
                    out.append((rank, g.device.name, node))
                    rank += 1
                node += 1
        return out

    def peak_flops(self, dtype: str) -> float:
        return sum(g.num_devices * g.device.flops(dtype) for g in self.groups)

    def to_dict(self) -> dict[str, Any]:
        def net(n: Network) -> dict[str, Any]:
            return {"nic_bandwidth": n.nic_bandwidth, "latency": n.latency, "num_nics": n.num_nics}

        d: dict[str, Any] = {
            "name": self.name,
            "network": net(self.network),
            "groups": [
                {
                    "device": dataclasses.asdict(g.device) | {"peak_flops": dict(g.device.peak_flops)},
                    "num_nodes": g.num_nodes,
                    "gpus_per_node": g.gpus_per_node,
                    "network": net(g.network),
                    "calibration": g.device.profile or "none",
                }
                for g in self.groups
            ],
        }
        if self.links:
            d["links"] = [{"between": [lk.a, lk.b], "network": net(lk.network)} for lk in self.links]
        return d

    def fingerprint(self) -> str:
        return hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True).encode()).hexdigest()[:16]

    def describe(self) -> str:
        return " + ".join(f"{g.num_nodes}x{g.gpus_per_node} {g.device.name}" for g in self.groups)

    def describe_network(self) -> str:
        """One line per node group and link: the network a plan assumed, and each group's calibration."""
        parts = [
            f"{g.device.name}: {self.group_network(i).describe()}"
            + (f", calibrated ({g.device.profile})" if g.device.profile else "")
            for i, g in enumerate(self.groups)
        ]
        parts += [f"group {lk.a}<->{lk.b}: {lk.network.describe()}" for lk in self.links]
        return "; ".join(parts)


CLUSTER_PRESETS: dict[str, str] = {
    "mixed-lab": "16xA100-80G+16xV100-32G+8xL4",  # the README's default mixed cluster
    "dgx-a100": "8xA100-80G",
    "a100-64": "64xA100-80G",
    "h100-1024": "1024xH100-80G",
    "local-cpu": "4xCPU",
}


def device_type(
    name: str, custom: Mapping[str, DeviceType] | None = None, calibrated: bool | None = None
) -> DeviceType:
    """A preset or custom device type; presets with a shipped profile come calibrated unless
    ``calibrated`` is False (None: :func:`calibration_default`)."""
    key = ALIASES.get(name, name)
    if custom and key in custom:
        return custom[key]
    for k, v in DEVICE_PRESETS.items():
        if k.lower() == key.lower():
            if k in SHIPPED_PROFILES and (calibration_default() if calibrated is None else calibrated):
                return _shipped(k)
            return v
    known = sorted([*DEVICE_PRESETS, *(custom or {})])
    raise ClusterSpecError(
        f"unknown device type {name!r}.",
        f"use one of {', '.join(known)}, or define it under 'device_types' in a cluster file.",
    )


_SHORT = re.compile(r"^\s*([0-9]+)\s*[xX*]\s*([A-Za-z0-9_.\-]+)\s*$")


def parse_shorthand(spec: str, gpus_per_node: int | None = None, calibrated: bool | None = None) -> Cluster:
    """``16xA100-80G+8xV100-32G``: each term a node group on its preset's reference node
    (devices per node unless ``gpus_per_node`` is given, and that node's network)."""
    groups = []
    for part in spec.split("+"):
        m = _SHORT.match(part)
        if not m:
            raise ClusterSpecError(
                f"cannot read cluster term {part!r} in {spec!r}.",
                "write COUNTxTYPE terms joined by '+', e.g. 16xA100-80G+8xV100-32G.",
            )
        count, dev = int(m.group(1)), device_type(m.group(2), calibrated=calibrated)
        if count <= 0:
            raise ClusterSpecError(f"device count {count} for {dev.name} must be positive.", "use COUNT >= 1.")
        choices = [k for k in DEVICE_PRESETS if k.lower().startswith(m.group(2).lower() + "-")]
        if len(choices) > 1:  # `8xA100`: 80 GB or 40 GB? A plan for the wrong one does not fit (issue 35)
            raise ClusterSpecError(
                f"{m.group(2)!r} in {spec!r} names {len(choices)} device types ({', '.join(choices)}) of different "
                "memory; a plan for one may not fit the other.",
                f"name one, e.g. {count}x{choices[0]} or {count}x{choices[-1]}.",
            )
        ref = REFERENCE_NODES.get(dev.name)
        per = gpus_per_node or (count if dev.kind == "cpu" else min(ref.gpus_per_node if ref else 8, count))
        if per <= 0:
            raise ClusterSpecError(f"gpus_per_node={per} must be positive.", "use --gpus-per-node >= 1.")
        if count % per:
            raise ClusterSpecError(
                f"{count} x {dev.name} does not split into nodes of {per}.",
                f"use a multiple of {per} or set --gpus-per-node to a divisor of {count}.",
            )
        groups.append(NodeGroup(dev, count // per, per, reference_network(dev)))
    return Cluster(spec.replace(" ", ""), tuple(groups))


MAX_DEVICES = 1 << 20  # devices in one cluster: far above any machine, far below what exhausts memory

# The fields each part of a cluster file may have (issue 34: an unknown one is refused, the nearest named).
TOP_FIELDS = ("name", "network", "nodes", "device_types", "links")
NODE_FIELDS = ("device", "num_nodes", "gpus_per_node", "intra_node_GBps", "profile", "network")
TYPE_FIELDS: tuple[str, ...] = ("name", "peak_tflops", "memory_GB", "hbm_GBps", "intra_node_GBps")
TYPE_FIELDS += ("intra_node_latency_us", "kind", "profile")
PEAK_DTYPES = ("bf16", "f16", "f32")  # the keys of a device type's peak_tflops: the dtypes a plan trains in


def _check_fields(d: Mapping[str, Any], allowed: Sequence[str], where: str, example: str = "") -> None:
    """Refuse a field ``d`` may not have, naming the nearest allowed one (a typo would be ignored)."""
    import difflib

    for key in d:
        if key in allowed:
            continue
        near = difflib.get_close_matches(str(key), list(allowed), n=1, cutoff=0.5)
        hint = f"; did you mean {near[0]!r}?" if near else "."
        raise ClusterSpecError(
            f"{where} has unknown field {key!r}{hint}",
            f"allowed: {', '.join(allowed)}." + (f" {example}" if example else ""),
        )


def _name(v: Any, where: str, what: str) -> str:
    """A device type's name: a non-empty string, not a list or a mapping."""
    if not isinstance(v, str) or not v.strip():
        raise ClusterSpecError(f"{where}: {what} is {v!r}, not a name.", f"write {what} as one name, e.g. A100-80G.")
    return v.strip()


def _num(d: Mapping[str, Any], key: str, where: str, default: float | None = None, positive: bool = True) -> float:
    if key not in d:
        if default is None:
            raise ClusterSpecError(f"{where} is missing field {key!r}.", f"add {key}: <number>.")
        return default
    v = d[key]
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ClusterSpecError(f"{where}: field {key!r} is {v!r}, not a number.", f"set {key} to a number.")
    if not math.isfinite(v):
        raise ClusterSpecError(f"{where}: field {key!r} is {v}, not a finite number.", f"set {key} to a finite number.")
    if positive and v <= 0:
        raise ClusterSpecError(f"{where}: field {key!r} is {v}, must be > 0.", f"set {key} to a positive value.")
    return float(v)


_NET_FIELDS = ("nic_gbps", "num_nics", "latency_us")


def _network_fields(net: Any, where: str) -> dict[str, float]:
    """The network fields a cluster file gives (``nic_gbps`` per NIC, ``num_nics``, ``latency_us``)."""
    if net is None:
        return {}
    if not isinstance(net, Mapping):
        raise ClusterSpecError(
            f"{where}: 'network' must be a mapping of {', '.join(_NET_FIELDS)} (got {net!r}).",
            "e.g. network: {nic_gbps: 200, num_nics: 8, latency_us: 5}.",
        )
    _check_fields(net, _NET_FIELDS, f"{where}: network", "e.g. network: {nic_gbps: 200, num_nics: 8, latency_us: 5}.")
    out = {k: _num(net, k, where + ".network") for k in _NET_FIELDS if k in net}
    if "num_nics" in out and out["num_nics"] != int(out["num_nics"]):
        raise ClusterSpecError(f"{where}: network.num_nics={out['num_nics']} is not a whole number.", "use 1, 2, 8...")
    return out


def _network(fields: Mapping[str, float]) -> Network:
    nics = int(fields["num_nics"])
    return Network(nics * fields["nic_gbps"] * 1e9 / 8, fields["latency_us"] / 1e6, nics)


def _reference_fields(dev: DeviceType) -> dict[str, float]:
    ref = REFERENCE_NODES.get(dev.name)
    if ref is None:
        return {"nic_gbps": 200.0, "num_nics": 1.0, "latency_us": 5.0}
    return {"nic_gbps": ref.nic_gbps, "num_nics": float(ref.num_nics), "latency_us": ref.latency_us}


def _group_index(ref: Any, groups: list[NodeGroup], where: str) -> int:
    if isinstance(ref, int) and not isinstance(ref, bool) and 0 <= ref < len(groups):
        return ref
    hits = [i for i, g in enumerate(groups) if isinstance(ref, str) and g.device.name == device_type(ref).name]
    if len(hits) == 1:
        return hits[0]
    raise ClusterSpecError(
        f"{where}: {ref!r} names no single node group.",
        f"use a group index 0..{len(groups) - 1}, or the device type of a group that is the only one of its type.",
    )


def cluster_from_dict(d: Any, source: str = "cluster spec", calibrated: bool | None = None) -> Cluster:
    """A cluster file's content. Networks: a node group's ``network`` overrides the file's top-level
    ``network``, which overrides the device type's reference node; ``links`` set the network
    between two groups (default: the slower side). ``profile: none`` keeps a preset uncalibrated."""
    if not isinstance(d, Mapping):
        raise ClusterSpecError(f"{source} must be a mapping with a 'nodes' list.", "see the README's cluster format.")
    _check_fields(d, TOP_FIELDS, source)
    top = _network_fields(d.get("network"), source)
    custom: dict[str, DeviceType] = {}
    types = d.get("device_types") or []
    if not isinstance(types, list):
        raise ClusterSpecError(
            f"{source}: 'device_types' must be a list of mappings.",
            "e.g. device_types: [{name: X, peak_tflops: {bf16: 100}, memory_GB: 24, hbm_GBps: 300}].",
        )
    for i, t in enumerate(types):
        where = f"{source}: device_types[{i}]"
        if not isinstance(t, Mapping) or "name" not in t:
            raise ClusterSpecError(f"{where} needs a 'name'.", "give each device type a name.")
        _check_fields(t, TYPE_FIELDS, where)
        name = _name(t["name"], where, "name")
        if name in custom:
            raise ClusterSpecError(
                f"{where}: device type {name!r} is defined twice.", "give each device type its own name."
            )
        preset = next((k for k in DEVICE_PRESETS if k.lower() == ALIASES.get(name, name).lower()), None)
        if preset is not None:
            raise ClusterSpecError(
                f"{where}: device type {name!r} has the name of the preset {preset}; it would replace it.",
                f"give it another name (e.g. {name}-custom), or drop it to use the preset.",
            )
        peaks = t.get("peak_tflops")
        if not isinstance(peaks, Mapping) or not peaks:
            raise ClusterSpecError(f"{where}: 'peak_tflops' must map dtypes to TFLOP/s.", "e.g. {bf16: 312}.")
        _check_fields(peaks, PEAK_DTYPES, where + ".peak_tflops", "e.g. peak_tflops: {bf16: 312, f32: 19.5}.")
        pk = {str(k): _num(peaks, k, where + ".peak_tflops") * 1e12 for k in peaks}
        kind = str(t.get("kind", "gpu"))
        if kind not in DEVICE_KINDS:
            raise ClusterSpecError(
                f"{where}: kind {t.get('kind')!r} is unknown (it decides the runtime backend).",
                f"set kind to one of {', '.join(DEVICE_KINDS)}.",
            )
        custom[name] = DeviceType(
            name,
            pk,
            _num(t, "memory_GB", where) * GB,
            _num(t, "hbm_GBps", where) * GB,
            _num(t, "intra_node_GBps", where, 32.0) * GB,
            _num(t, "intra_node_latency_us", where, 2.0) * 1e-6,
            kind,
        )
        if t.get("profile") and str(t["profile"]).lower() != "none":
            custom[name] = apply_profile(custom[name], str(t["profile"]))
    nodes = d.get("nodes")
    if not isinstance(nodes, list) or not nodes:
        raise ClusterSpecError(f"{source} has no 'nodes' list.", "add nodes: [{device: A100-80G, num_nodes: 1}].")
    groups = []
    for i, n in enumerate(nodes):
        where = f"{source}: nodes[{i}]"
        if not isinstance(n, Mapping) or "device" not in n:
            raise ClusterSpecError(f"{where} needs a 'device'.", "e.g. {device: A100-80G, num_nodes: 2}.")
        _check_fields(n, NODE_FIELDS, where, "e.g. {device: A100-80G, num_nodes: 2, gpus_per_node: 8}.")
        off = str(n.get("profile", "")).lower() == "none"
        dev = device_type(_name(n["device"], where, "device"), custom, calibrated=False if off else calibrated)
        overrides: dict[str, Any] = {}
        if "intra_node_GBps" in n:
            overrides["intra_node_bandwidth"] = _num(n, "intra_node_GBps", where) * GB
        if overrides:
            dev = dataclasses.replace(dev, **overrides)
        if n.get("profile") and not off:
            dev = apply_profile(dev, str(n["profile"]))
        num_nodes = _num(n, "num_nodes", where, 1.0)
        per = _num(n, "gpus_per_node", where, 8.0 if dev.kind == "gpu" else 1.0)
        if num_nodes != int(num_nodes) or per != int(per):
            raise ClusterSpecError(f"{where}: num_nodes and gpus_per_node must be integers.", "use whole numbers.")
        fields = _reference_fields(dev) | top | _network_fields(n.get("network"), where)
        groups.append(NodeGroup(dev, int(num_nodes), int(per), _network(fields)))
    links = d.get("links") or []
    if not isinstance(links, list):
        raise ClusterSpecError(
            f"{source}: 'links' must be a list.", "e.g. links: [{between: [0, 1], nic_gbps: 100, num_nics: 1}]."
        )
    out = []
    for i, lk in enumerate(links):
        where = f"{source}: links[{i}]"
        if not isinstance(lk, Mapping) or not isinstance(lk.get("between"), list) or len(lk["between"]) != 2:
            raise ClusterSpecError(
                f"{where} needs 'between': two node groups.", "e.g. {between: [0, 1], nic_gbps: 100, num_nics: 1}."
            )
        a, b = (_group_index(x, groups, where) for x in lk["between"])
        if a == b:
            raise ClusterSpecError(f"{where} links group {a} to itself.", "name two different node groups.")
        side = groups[a].network.slower(groups[b].network)
        base = {"nic_gbps": side.nic_bandwidth * 8 / 1e9 / side.num_nics, "num_nics": float(side.num_nics)}
        base["latency_us"] = side.latency * 1e6
        _check_fields(lk, ("between", *_NET_FIELDS), where)
        fields = base | _network_fields({k: v for k, v in lk.items() if k != "between"}, where)
        out.append(GroupLink(a, b, _network(fields)))
    return Cluster(str(d.get("name", Path(source).stem)), tuple(groups), links=tuple(out))


def parse_cluster(spec: str, gpus_per_node: int | None = None, calibrated: bool | None = None) -> Cluster:
    """Shorthand, preset name, or path to a .yaml/.yml/.json file. ``calibrated``: apply the shipped
    calibration profiles (``SHIPPED_PROFILES``); None reads ``PARTITA_CALIBRATION`` (default on)."""
    if spec in CLUSTER_PRESETS:
        return dataclasses.replace(parse_shorthand(CLUSTER_PRESETS[spec], gpus_per_node, calibrated), name=spec)
    path = Path(spec)
    if path.suffix.lower() in (".yaml", ".yml", ".json"):
        from partita.user_files import DuplicateKey, NonFinite, loads_json, read_user_text, yaml_loader

        if gpus_per_node is not None:  # it would be ignored: a file sets each node group's own
            raise ClusterSpecError(
                f"--gpus-per-node {gpus_per_node} applies to shorthand clusters, but {spec!r} is a cluster file.",
                "set gpus_per_node on each node in the file, and drop --gpus-per-node.",
            )

        if not path.exists() and not path.is_symlink():
            raise ClusterSpecError(f"cluster file {spec!r} does not exist.", "check the path.")
        fix = "pass a readable YAML or JSON text file (see the README's format)."
        text = read_user_text(path, "cluster file", fix, ClusterSpecError, max_bytes=16 << 20)
        try:
            if path.suffix.lower() == ".json":
                data = loads_json(text)
            else:
                import yaml

                data = yaml.load(text, Loader=yaml_loader())  # noqa: S506 - a SafeLoader subclass
        except DuplicateKey as e:
            raise ClusterSpecError(
                f"cluster file {spec!r} names the key {e.args[0]!r} twice in one mapping; only one would count.",
                f"keep one {e.args[0]!r} (merge the two).",
            ) from None
        except NonFinite as e:
            raise ClusterSpecError(f"cluster file {spec!r} holds {e.args[0]}.", "write a finite number.") from None
        except Exception as e:  # noqa: BLE001 - any parser error becomes one clear message
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            mark = getattr(e, "problem_mark", None)
            if mark is not None:
                first = f"{getattr(e, 'problem', None) or first} at line {mark.line + 1}, column {mark.column + 1}"
            raise ClusterSpecError(
                f"cluster file {spec!r} is not valid {path.suffix[1:].upper()}: {first}.",
                "fix the syntax at the position given.",
            ) from None
        return cluster_from_dict(data, spec, calibrated)
    if "/" in spec or os.sep in spec:
        where = "is a directory" if path.is_dir() else ("exists" if path.exists() else "does not exist")
        raise ClusterSpecError(
            f"cluster {spec!r} looks like a path, but it {where} and a cluster file ends in .yaml, .yml or .json.",
            "pass the cluster file's path (e.g. lab.yaml), a preset name, or a shorthand such as 8xA100-80G.",
        )
    return parse_shorthand(spec, gpus_per_node, calibrated)


# ---- calibration profiles ------------------------------------------------------------------
def read_profile(profile: str | Path | Mapping[str, Any]) -> dict[str, Any]:
    """A profile as a dict, checked for JSON, format and version (:class:`ProfileError` otherwise)."""
    src = "profile"
    if not isinstance(profile, Mapping):
        src = str(profile)
        try:
            profile = json.loads(profile_path(profile).read_text())
        except FileNotFoundError:
            raise ProfileError(f"profile {src!r} does not exist.", "run `partita profile` or fix the path.") from None
        except IsADirectoryError:
            raise ProfileError(f"profile {src!r} is a directory.", "pass the profile's JSON file.") from None
        except (OSError, ValueError) as e:  # a name too long, a NUL byte in the name, not a directory...
            if not isinstance(e, (json.JSONDecodeError, UnicodeDecodeError)):
                why = getattr(e, "strerror", None) or str(e)
                raise ProfileError(
                    f"profile {src!r} cannot be read ({why}).",
                    "pass the path of a profile written by `partita profile`.",
                ) from None
            why = e.msg if isinstance(e, json.JSONDecodeError) else "not UTF-8"
            raise ProfileError(f"profile {src!r} is not valid JSON ({why}).", "re-run the profiler.") from None
            why = e.msg if isinstance(e, json.JSONDecodeError) else "not UTF-8"
            raise ProfileError(f"profile {src!r} is not valid JSON ({why}).", "re-run the profiler.") from None
    if not isinstance(profile, Mapping) or profile.get("format") != PROFILE_FORMAT:
        raise ProfileError(f"{src} is not a Partita efficiency profile.", f"it needs format={PROFILE_FORMAT!r}.")
    if profile.get("version") != PROFILE_VERSION:
        raise ProfileError(
            f"{src} has version {profile.get('version')!r}; this Partita reads {PROFILE_VERSION}.",
            "re-run `partita profile` with this version.",
        )
    return dict(profile)


def profile_content_hash(profile: Mapping[str, Any]) -> str:
    """Hash of what a profile changes in planning (efficiency + overrides), not its raw tables or path."""
    payload = {k: profile.get(k) for k in _PROFILE_PLANNING_KEYS if k in profile or k not in _PROFILE_LATER_KEYS}
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


def apply_profile(dev: DeviceType, profile: str | Path) -> DeviceType:
    """``dev`` with the profile's absolute ``device_overrides`` applied, ``profile`` and
    ``profile_hash`` set. Refuses a profile measured on another device type or kind."""
    d = read_profile(profile)
    fields = profile_overrides(dev, d, str(profile))
    return dataclasses.replace(dev, **fields, profile=str(profile), profile_hash=profile_content_hash(d))


def profile_overrides(dev: DeviceType, d: Mapping[str, Any], src: str = "profile") -> dict[str, Any]:
    """The ``DeviceType`` fields a read profile ``d`` sets on ``dev``, after checking that it was
    measured on that device type and kind and that its overrides are known positive numbers."""
    measured = str(d.get("device", ""))
    also = d.get("applies_to", [])
    if measured and measured != dev.name and dev.name not in (also if isinstance(also, list) else []):
        raise ProfileError(
            f"{src} was measured on {measured}, not {dev.name}.", f"use a profile measured on {dev.name}."
        )
    kind = d.get("host", {}).get("device_kind") if isinstance(d.get("host"), Mapping) else None
    if kind and kind != dev.kind:
        raise ProfileError(f"{src} was measured on a {kind} device, not a {dev.kind} one.", "use a matching profile.")
    ov = d.get("device_overrides", {})
    if not isinstance(ov, Mapping) or set(ov) - set(PROFILE_OVERRIDES):
        bad = sorted(ov) if isinstance(ov, Mapping) else ov
        raise ProfileError(f"{src} has unknown device_overrides {bad}.", f"allowed: {list(PROFILE_OVERRIDES)}.")
    fields: dict[str, Any] = {}
    for key, val in ov.items():
        vals = val if key == "peak_flops" and isinstance(val, Mapping) else {"": val}
        ok = bool(vals) and all(
            not isinstance(v, bool)
            and isinstance(v, (int, float))
            and math.isfinite(v)
            and (v > 0 or (v == 0 and key == "intra_node_latency"))
            for v in vals.values()
        )
        if not ok or (key == "peak_flops" and not isinstance(val, Mapping)):
            raise ProfileError(
                f"{src}: device_overrides.{key}={val!r} is not a positive number.", "re-run the profiler."
            )
        fields[key] = (
            {**dev.peak_flops, **{str(k): float(v) for k, v in vals.items()}} if key == "peak_flops" else float(val)
        )
    return fields


_SHIPPED: dict[str, DeviceType] = {}


def _shipped(name: str) -> DeviceType:
    """The preset ``name`` with its shipped calibration profile applied (cached)."""
    if name not in _SHIPPED:
        _SHIPPED[name] = apply_profile(DEVICE_PRESETS[name], SHIPPED_PROFILES[name])
    return _SHIPPED[name]
