"""Analytic cost model per device type: roofline compute, alpha-beta collectives, training memory.

Used by ``search/layer/intra_op.py`` to price every (op, strategy) and every resharding, and by the
inter-op search through :class:`~partita.search.layer.intra_op.LayerSolution`. No framework imports.

Compute (one kernel, per device)::

    t = max(flops / (peak[dtype] * eff_flops), bytes / (hbm * eff.memory)) + eff.kernel_overhead_s

``eff_flops`` for a MATMUL whose per-device shape ``(batch, m, n, k)`` the caller passes, on a device
type with an SM count in ``partita/data/gemm_tiles.json``: ``eff.matmul * shape`` (tile and wave
quantization, ``search/pricing/gemm.py``; its backward is priced as its two GEMMs, ``dA`` and ``dB``);
else (a CONV, a CPU rank, a device type without the table) the curve ``eff.matmul * F / (F +
eff.matmul_half_flops)`` (F = the kernel's per-device FLOPs: small GEMMs do not fill the GPU, large ones
saturate at ``eff.matmul``); ``eff.attention`` for ATTENTION and ``eff.matmul`` for anything else with FLOPs.

Collectives over ``p`` devices of one mesh axis with link bandwidth ``B`` (bytes/s per ring, see
``search/pricing/mesh.py``) and per-hop latency ``alpha``; ``S`` is the per-device size of the larger
buffer: the gathered *output* of an all-gather, the *input* of a reduce-scatter, the buffer of an
all-reduce, the per-device send buffer of an all-to-all::

    all_reduce                           2 (p-1)/p * S / (B * eff_bw) + 2 (p-1) alpha + eff.collective_latency_s
    all_gather/reduce_scatter/all_to_all   (p-1)/p * S / (B * eff_bw) +   (p-1) alpha + eff.collective_latency_s

``eff_bw`` is ``eff.collective_bandwidth`` inside a node (the preset NVLink numbers are
bidirectional aggregates; NCCL's bus bandwidth reaches ~40% of them) and ``eff.network_bandwidth``
across nodes (NIC numbers are per direction).

Overlap is not free: while a ZeRO-2/3 (FSDP) all-gather or reduce-scatter runs beside a micro-batch's
compute, NCCL's kernels hold SMs and HBM bandwidth, so the compute slows. A micro-batch with compute ``t``
and in-micro-batch traffic ``sync`` costs ``max(t, sync) + eff.overlap_interference * min(t, sync)``
(``search/pipeline/stage_ranges.stage_parts``). The GPU default 0.2 is the share of an H100's SMs one NCCL
all-gather held in a public Nsight trace (24 of 132 blocks, NVIDIA developer forum, "Compute-Communication
Overlap Causes Severe GEMM Performance Degradation because of Tail Effect"), rounded up for HBM contention;
it is not fitted on any measured row (sources in ``partita/data/README.md``). CPU ranks: 0.

Training memory per parameter element (mixed precision when ``dtype`` is 2 bytes): bf16 param and
grad (2 + 2) plus fp32 master + two Adam moments (12) = 16 bytes for "adam"; "sgd" keeps only the
fp32 master (4 + 4 = 8). With f32 training there is no master copy: adam 4 + 4 + 8, sgd 4 + 4.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from partita.cluster import PROFILE_FORMAT, PROFILE_VERSION, DeviceType, ProfileError, apply_profile, read_profile
from partita.errors import ConfigError
from partita.ir import DTYPE_BYTES, Graph, Prim, Role
from partita.search.pricing import fp8, gemm
from partita.search.pricing.mesh import AxisLink

__all__ = ["PROFILE_FORMAT", "PROFILE_VERSION", "ProfileError", "Efficiency", "CostModel"]
OPTIMIZERS = ("adam", "sgd")
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")

# Backward compute relative to forward: dX and dW for contractions, one pass otherwise.
BACKWARD_MULTIPLIER: dict[Prim, float] = {Prim.MATMUL: 2.0, Prim.ATTENTION: 2.0, Prim.CONV: 2.0}
_MATMUL_LIKE = (Prim.MATMUL, Prim.CONV)


@dataclasses.dataclass(frozen=True)
class Efficiency:
    """Calibration factors; defaults are typical published fractions for A100/H100-class GPUs."""

    matmul: float = 0.75  # large bf16 GEMMs reach ~75% of dense peak with cuBLAS
    matmul_half_flops: float = 2e9  # per-kernel FLOPs at which a GEMM reaches half of `matmul`
    attention: float = 0.5  # flash attention forward ~50% of peak
    memory: float = 0.8  # fraction of HBM bandwidth a streaming kernel reaches
    kernel_overhead_s: float = 5e-6  # launch + tail per kernel
    collective_bandwidth: float = 0.4  # NCCL bus bandwidth / preset intra-node (bidirectional) number
    network_bandwidth: float = 0.85  # achieved / NIC line rate
    collective_latency_s: float = 10e-6  # fixed cost per collective call
    pointwise_fusion: float = 0.0  # share of fusable intermediate traffic removed (0 eager, 1 fused)
    # training-step terms (``search/pipeline/stage_cost.py``); the defaults leave GPU predictions as they were
    optimizer_tensor_s: float = 0.0  # fixed optimizer-step cost per parameter tensor (eager for-loop Adam)
    optimizer_memory: float = 0.8  # fraction of HBM bandwidth the optimizer step streams its states at
    comm_overlap: float = 1.0  # fraction of the backward that can hide the gradient sync on this device
    # share of the time a ZeRO-2/3 (FSDP) collective runs beside a micro-batch's compute that the compute
    # loses to it (NCCL kernels hold SMs and HBM bandwidth: overlap is not free; the module docstring)
    overlap_interference: float = 0.2
    device: str = ""  # device type the factors were measured on ("" = generic defaults)

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name != "device" and (isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0):
                raise ProfileError(f"efficiency field {f.name}={v!r} is not a number >= 0.", "fix the profile.")
        if self.pointwise_fusion > 1:
            raise ProfileError(f"efficiency pointwise_fusion={self.pointwise_fusion} is above 1.", "use 0..1.")
        for name in ("matmul", "attention", "memory", "collective_bandwidth", "network_bandwidth"):
            if not 0 < getattr(self, name) <= 1:
                raise ProfileError(f"efficiency {name}={getattr(self, name)} must be in (0, 1].", "fix the profile.")
        if self.overlap_interference > 1:
            raise ProfileError(f"efficiency overlap_interference={self.overlap_interference} is above 1.", "use 0..1.")
        if self.comm_overlap > 1 or self.optimizer_memory <= 0:
            raise ProfileError(
                f"efficiency comm_overlap={self.comm_overlap} / optimizer_memory={self.optimizer_memory} is out of "
                "range.",
                "use comm_overlap in 0..1 and optimizer_memory > 0.",
            )

    def matmul_efficiency(self, flops: float) -> float:
        """Saturating curve: ``matmul * F / (F + matmul_half_flops)``."""
        return self.matmul * flops / (flops + self.matmul_half_flops) if flops > 0 else self.matmul

    @staticmethod
    def from_profile(profile: str | Path | Mapping[str, Any], device: str | None = None) -> Efficiency:
        """Load ``{"format": "partita.efficiency", "version": 1, "device": NAME, "efficiency": {...}}``."""
        src = "profile" if isinstance(profile, Mapping) else str(profile)
        profile = read_profile(profile)  # JSON, format and version, worded in cluster.py
        dev = str(profile.get("device", ""))
        also = profile.get("applies_to", [])
        if device is not None and dev and dev != device and device not in (also if isinstance(also, list) else []):
            raise ProfileError(f"{src} was measured on {dev}, not {device}.", f"use a profile measured on {device}.")
        fields = profile.get("efficiency", {})
        known = {f.name for f in dataclasses.fields(Efficiency)} - {"device"}
        if not isinstance(fields, Mapping) or set(fields) - known:
            bad = sorted(set(fields) - known) if isinstance(fields, Mapping) else fields
            raise ProfileError(f"{src} has unknown efficiency fields {bad}.", f"allowed: {sorted(known)}.")
        return Efficiency(**{k: float(v) for k, v in fields.items()}, device=dev)

    def to_profile(self) -> dict[str, Any]:
        eff = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "device"}
        return {"format": PROFILE_FORMAT, "version": PROFILE_VERSION, "device": self.device, "efficiency": eff}


# Uncalibrated defaults for a CPU "device" (one gloo rank): GEMMs saturate at far fewer FLOPs than on
# a GPU, kernels cost tens of microseconds in eager PyTorch, and gloo collectives pay ~100 us each.
# `partita profile --devices cpu` measures the real numbers.
CPU_EFFICIENCY = Efficiency(
    matmul=0.5,
    matmul_half_flops=2e6,
    attention=0.3,
    memory=0.5,
    kernel_overhead_s=2e-5,
    collective_bandwidth=0.5,
    network_bandwidth=0.5,
    collective_latency_s=1e-4,
    overlap_interference=0.0,  # gloo's collectives run on host threads, not beside GPU kernels
    device="CPU",
)


def state_bytes_per_param(dtype: str, optimizer: str) -> tuple[int, int, int]:
    """(param, grad, optimizer-state) bytes per parameter element; see the module docstring."""
    if optimizer not in OPTIMIZERS:
        raise ConfigError(f"optimizer {optimizer!r} is not supported.", f"use one of {OPTIMIZERS}.")
    if dtype not in DTYPE_BYTES:
        raise ConfigError(f"dtype {dtype!r} is unknown.", f"use one of {sorted(DTYPE_BYTES)}.")
    item = DTYPE_BYTES[dtype]
    master = 4 if item < 4 else 0
    moments = 8 if optimizer == "adam" else 0
    return item, item, master + moments


def program_state_bytes(graph: Graph, dtype: str, optimizer: str) -> tuple[int, int, int]:
    """:func:`state_bytes_per_param` as the graph's program keeps its state. The torch program: f32
    parameters (the master copy: autocast, or FSDP2's sharded f32 under a MixedPrecisionPolicy), f32
    gradients and moments (``backends/torch/parallel.precision_of``). The JAX program differentiates
    the parameters as declared (no mixed precision, ``backends/jax/train.py``): their traced dtype
    (``search/program/jax_records.py`` records the same). A test graph: the training ``dtype``."""
    framework = graph.meta.get("framework")
    if framework == "torch":
        return state_bytes_per_param("f32", optimizer)
    if framework == "jax":
        item = next((t.dtype for t in graph.tensors.values() if t.role is Role.PARAMETER), "f32")
        return state_bytes_per_param("f32" if DTYPE_BYTES.get(item, 4) >= 4 else item, optimizer)
    return state_bytes_per_param(dtype, optimizer)


@dataclasses.dataclass(frozen=True)
class CostModel:
    device: DeviceType
    efficiency: Efficiency = Efficiency()
    fp8: str | None = None  # a torchao recipe: MATMULs priced in FP8 with their casts (search/pricing/fp8.py)

    @staticmethod
    def for_device(device: DeviceType) -> CostModel:
        """Defaults, or the device's calibration profile when ``device.profile`` names one (its
        ``device_overrides`` too, when the device was not built by ``cluster.apply_profile``)."""
        if device.profile:
            if not device.profile_hash:
                device = apply_profile(device, device.profile)
            return CostModel(device, Efficiency.from_profile(device.profile, device.name))
        return CostModel(device, CPU_EFFICIENCY if device.kind == "cpu" else Efficiency())

    def fingerprint(self) -> str:
        d: dict[str, Any] = {"device": dataclasses.asdict(self.device) | {"peak_flops": dict(self.device.peak_flops)}}
        d["efficiency"] = dataclasses.asdict(self.efficiency)
        if self.fp8:
            d["fp8"] = self.fp8
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]

    def matmul_efficiency(self, flops: float, shape: tuple[int, int, int, int] | None = None) -> float:
        """``eff_flops`` of a MATMUL (module docstring): by ``shape`` where the device has an SM count."""
        sms = gemm.sm_count(self.device.name) if shape is not None and self.device.kind == "gpu" else None
        if sms is not None and shape is not None:
            return self.efficiency.matmul * gemm.shape_efficiency(sms, *shape)
        return self.efficiency.matmul_efficiency(flops)

    def compute_time(
        self, prim: Prim, flops: float, bytes_moved: float, dtype: str, shape: tuple[int, int, int, int] | None = None
    ) -> float:
        """Roofline time of one kernel on one device (module docstring); ``shape``: a MATMUL's per-device
        ``(batch, m, n, k)`` (``search/pricing/gemm.local_shape``), None when not known."""
        eff = self.efficiency
        t_mem = bytes_moved / (self.device.hbm_bandwidth * eff.memory)
        mm_shape = shape if prim is Prim.MATMUL else None
        if self.fp8 and prim is Prim.MATMUL and dtype == "bf16":
            e = self.matmul_efficiency(flops, mm_shape) if flops > 0 else 1.0
            return fp8.gemm_time(flops, bytes_moved, self.device, e, eff.memory, eff.kernel_overhead_s)
        t_flop = 0.0
        if flops > 0:
            if prim in _MATMUL_LIKE:
                e = self.matmul_efficiency(flops, mm_shape)
            elif prim is Prim.ATTENTION:
                e = eff.attention
            else:
                e = eff.matmul
            t_flop = flops / (self.device.flops(dtype) * e)
        return max(t_flop, t_mem) + eff.kernel_overhead_s

    def backward_compute_time(
        self, prim: Prim, flops: float, bytes_moved: float, dtype: str, shape: tuple[int, int, int, int] | None = None
    ) -> float:
        """Backward of one kernel: a MATMUL with a known shape as its two GEMMs (``dA``, ``dB``; each the
        forward's FLOPs and bytes), anything else as ``BACKWARD_MULTIPLIER`` times the forward."""
        if prim is Prim.MATMUL and shape is not None and gemm.sm_count(self.device.name) is not None:
            return sum(self.compute_time(prim, flops, bytes_moved, dtype, s) for s in gemm.backward_shapes(shape))
        m = BACKWARD_MULTIPLIER.get(prim, 1.0)
        return self.compute_time(prim, m * flops, m * bytes_moved, dtype)

    def collective_time(self, kind: str, nbytes: float, link: AxisLink) -> float:
        """Alpha-beta time of one collective on one mesh axis (module docstring; S = ``nbytes``)."""
        p = link.size
        if p <= 1 or nbytes <= 0:
            return 0.0
        eff = self.efficiency
        bw = link.bandwidth * (eff.network_bandwidth if link.crosses_nodes else eff.collective_bandwidth)
        if kind == "all_reduce":
            return 2 * (p - 1) / p * nbytes / bw + 2 * (p - 1) * link.latency + eff.collective_latency_s
        if kind in COLLECTIVES:
            return (p - 1) / p * nbytes / bw + (p - 1) * link.latency + eff.collective_latency_s
        raise ValueError(f"unknown collective {kind!r}")
