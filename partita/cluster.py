"""Cluster specs: device types, nodes, links. Bottom layer, no framework imports.

A cluster is a list of node groups; each group is ``num_nodes`` nodes of one device type with
``gpus_per_node`` devices joined by an intra-node link (NVLink, PCIe, or shared memory for CPU
ranks). Nodes talk over one network whose per-node bandwidth is the NIC bandwidth; a collective
that spans nodes is priced at the slowest link it crosses (see ``search/cost_model.py``).

Three ways to name a cluster (:func:`parse_cluster`):

* shorthand ``16xA100-80G+8xV100-32G`` (8 devices per node unless ``gpus_per_node`` is given);
* a preset name from :data:`CLUSTER_PRESETS`;
* a YAML or JSON file, see ``docs`` in the README::

    name: lab
    network: {nic_gbps: 200, latency_us: 5}
    nodes:
      - {device: A100-80G, num_nodes: 2, gpus_per_node: 8}
      - {device: L4, num_nodes: 1, gpus_per_node: 8, intra_node_GBps: 32}
    device_types:            # optional: types not in the presets
      - {name: MI250, peak_tflops: {bf16: 362}, memory_GB: 64, hbm_GBps: 3277}

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
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from partita.errors import ClusterSpecError

# Calibration profile format (``partita profile``); ``search/cost_model.py`` re-exports these.
PROFILE_FORMAT = "partita.efficiency"
PROFILE_VERSION = 1
PROFILE_OVERRIDES = ("peak_flops", "hbm_bandwidth", "intra_node_bandwidth", "intra_node_latency")
_PROFILE_PLANNING_KEYS = ("format", "version", "device", "efficiency", "device_overrides", "profiler_version")


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
DEVICE_KINDS = ("gpu", "cpu")  # gpu -> nccl, cpu -> gloo


@dataclasses.dataclass(frozen=True)
class NodeGroup:
    device: DeviceType
    num_nodes: int
    gpus_per_node: int

    @property
    def num_devices(self) -> int:
        return self.num_nodes * self.gpus_per_node


@dataclasses.dataclass(frozen=True)
class Network:
    nic_bandwidth: float = 200e9 / 8  # bytes/s per node (200 Gb/s default)
    latency: float = 5e-6


@dataclasses.dataclass(frozen=True)
class Cluster:
    name: str
    groups: tuple[NodeGroup, ...]
    network: Network = Network()

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
        return {
            "name": self.name,
            "network": {"nic_bandwidth": self.network.nic_bandwidth, "latency": self.network.latency},
            "groups": [
                {
                    "device": dataclasses.asdict(g.device) | {"peak_flops": dict(g.device.peak_flops)},
                    "num_nodes": g.num_nodes,
                    "gpus_per_node": g.gpus_per_node,
                }
                for g in self.groups
            ],
        }

    def fingerprint(self) -> str:
        return hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True).encode()).hexdigest()[:16]

    def describe(self) -> str:
        return " + ".join(f"{g.num_nodes}x{g.gpus_per_node} {g.device.name}" for g in self.groups)


CLUSTER_PRESETS: dict[str, str] = {
    "mixed-lab": "16xA100-80G+16xV100-32G+8xL4",  # the README's default mixed cluster
    "dgx-a100": "8xA100-80G",
    "a100-64": "64xA100-80G",
    "h100-1024": "1024xH100-80G",
    "local-cpu": "4xCPU",
}


def device_type(name: str, custom: Mapping[str, DeviceType] | None = None) -> DeviceType:
    key = ALIASES.get(name, name)
    if custom and key in custom:
        return custom[key]
    for k, v in DEVICE_PRESETS.items():
        if k.lower() == key.lower():
            return v
    known = sorted([*DEVICE_PRESETS, *(custom or {})])
    raise ClusterSpecError(
        f"unknown device type {name!r}.",
        f"use one of {', '.join(known)}, or define it under 'device_types' in a cluster file.",
    )


_SHORT = re.compile(r"^\s*(\d+)\s*[xX*]\s*([A-Za-z0-9_.\-]+)\s*$")


def parse_shorthand(spec: str, gpus_per_node: int | None = None) -> Cluster:
    groups = []
    for part in spec.split("+"):
        m = _SHORT.match(part)
        if not m:
            raise ClusterSpecError(
                f"cannot read cluster term {part!r} in {spec!r}.",
                "write COUNTxTYPE terms joined by '+', e.g. 16xA100-80G+8xV100-32G.",
            )
        count, dev = int(m.group(1)), device_type(m.group(2))
        if count <= 0:
            raise ClusterSpecError(f"device count {count} for {dev.name} must be positive.", "use COUNT >= 1.")
        per = gpus_per_node or (count if dev.kind == "cpu" else min(8, count))
        if per <= 0:
            raise ClusterSpecError(f"gpus_per_node={per} must be positive.", "use --gpus-per-node >= 1.")
        if count % per:
            raise ClusterSpecError(
                f"{count} x {dev.name} does not split into nodes of {per}.",
                f"use a multiple of {per} or set --gpus-per-node to a divisor of {count}.",
            )
        groups.append(NodeGroup(dev, count // per, per))
    return Cluster(spec.replace(" ", ""), tuple(groups))


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


def cluster_from_dict(d: Any, source: str = "cluster spec") -> Cluster:
    if not isinstance(d, Mapping):
        raise ClusterSpecError(f"{source} must be a mapping with a 'nodes' list.", "see the README's cluster format.")
    unknown = set(d) - {"name", "network", "nodes", "device_types"}
    if unknown:
        raise ClusterSpecError(
            f"{source} has unknown fields {sorted(unknown)}.", "allowed: name, network, nodes, device_types."
        )
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
        peaks = t.get("peak_tflops")
        if not isinstance(peaks, Mapping) or not peaks:
            raise ClusterSpecError(f"{where}: 'peak_tflops' must map dtypes to TFLOP/s.", "e.g. {bf16: 312}.")
        pk = {str(k): _num(peaks, k, where + ".peak_tflops") * 1e12 for k in peaks}
        kind = str(t.get("kind", "gpu"))
        if kind not in DEVICE_KINDS:
            raise ClusterSpecError(
                f"{where}: kind {t.get('kind')!r} is unknown (it decides the runtime backend).",
                f"set kind to one of {', '.join(DEVICE_KINDS)}.",
            )
        custom[str(t["name"])] = DeviceType(
            str(t["name"]),
            pk,
            _num(t, "memory_GB", where) * GB,
            _num(t, "hbm_GBps", where) * GB,
            _num(t, "intra_node_GBps", where, 32.0) * GB,
            _num(t, "intra_node_latency_us", where, 2.0) * 1e-6,
            kind,
        )
        if t.get("profile"):
            custom[str(t["name"])] = apply_profile(custom[str(t["name"])], str(t["profile"]))
    nodes = d.get("nodes")
    if not isinstance(nodes, list) or not nodes:
        raise ClusterSpecError(f"{source} has no 'nodes' list.", "add nodes: [{device: A100-80G, num_nodes: 1}].")
    groups = []
    for i, n in enumerate(nodes):
        where = f"{source}: nodes[{i}]"
        if not isinstance(n, Mapping) or "device" not in n:
            raise ClusterSpecError(f"{where} needs a 'device'.", "e.g. {device: A100-80G, num_nodes: 2}.")
        dev = device_type(str(n["device"]), custom)
        overrides: dict[str, Any] = {}
        if "intra_node_GBps" in n:
            overrides["intra_node_bandwidth"] = _num(n, "intra_node_GBps", where) * GB
        if overrides:
            dev = dataclasses.replace(dev, **overrides)
        if n.get("profile"):
            dev = apply_profile(dev, str(n["profile"]))
        num_nodes = _num(n, "num_nodes", where, 1.0)
        per = _num(n, "gpus_per_node", where, 8.0 if dev.kind == "gpu" else 1.0)
        if num_nodes != int(num_nodes) or per != int(per):
            raise ClusterSpecError(f"{where}: num_nodes and gpus_per_node must be integers.", "use whole numbers.")
        groups.append(NodeGroup(dev, int(num_nodes), int(per)))
    net = d.get("network") or {}
    if not isinstance(net, Mapping):
        raise ClusterSpecError(f"{source}: 'network' must be a mapping.", "e.g. network: {nic_gbps: 200}.")
    network = Network(
        _num(net, "nic_gbps", f"{source}: network", 200.0) * 1e9 / 8,
        _num(net, "latency_us", f"{source}: network", 5.0) * 1e-6,
    )
    return Cluster(str(d.get("name", Path(source).stem)), tuple(groups), network)


def parse_cluster(spec: str, gpus_per_node: int | None = None) -> Cluster:
    """Shorthand, preset name, or path to a .yaml/.yml/.json file."""
    if spec in CLUSTER_PRESETS:
        return dataclasses.replace(parse_shorthand(CLUSTER_PRESETS[spec], gpus_per_node), name=spec)
    path = Path(spec)
    if path.suffix.lower() in (".yaml", ".yml", ".json"):
        if not path.exists():
            raise ClusterSpecError(f"cluster file {spec!r} does not exist.", "check the path.")
        try:
            text = path.read_bytes().decode("utf-8")
        except (OSError, UnicodeDecodeError) as e:
            why = "is not UTF-8 text" if isinstance(e, UnicodeDecodeError) else f"cannot be read ({e.strerror})"
            raise ClusterSpecError(
                f"cluster file {spec!r} {why}.", "pass a readable YAML or JSON text file (see the README's format)."
            ) from None
        try:
            if path.suffix.lower() == ".json":
                data = json.loads(text)
            else:
                import yaml

                data = yaml.safe_load(text)
        except Exception as e:  # noqa: BLE001 - any parser error becomes one clear message
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            mark = getattr(e, "problem_mark", None)
            if mark is not None:
                first = f"{getattr(e, 'problem', None) or first} at line {mark.line + 1}, column {mark.column + 1}"
            raise ClusterSpecError(
                f"cluster file {spec!r} is not valid {path.suffix[1:].upper()}: {first}.",
                "fix the syntax at the position given.",
            ) from None
        return cluster_from_dict(data, spec)
    return parse_shorthand(spec, gpus_per_node)


# ---- calibration profiles ------------------------------------------------------------------
def read_profile(profile: str | Path | Mapping[str, Any]) -> dict[str, Any]:
    """A profile as a dict, checked for JSON, format and version (:class:`ProfileError` otherwise)."""
    src = "profile"
    if not isinstance(profile, Mapping):
        src = str(profile)
        try:
            profile = json.loads(Path(profile).read_text())
        except (FileNotFoundError, IsADirectoryError):
            raise ProfileError(f"profile {src!r} does not exist.", "run `partita profile` or fix the path.") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
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
    payload = {k: profile.get(k) for k in _PROFILE_PLANNING_KEYS}
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
    if measured and measured != dev.name:
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
