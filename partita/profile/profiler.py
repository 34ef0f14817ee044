"""Profiler: measure this machine and write a calibration profile for the cost model.

Sits beside the runtime: ``partita profile`` calls :func:`profile`, which measures the local
devices and writes a JSON profile; a cluster spec names it (``nodes: [{device: CPU, profile:
PATH}]``): ``cluster.apply_profile`` applies its absolute ``device_overrides`` to the device type
and ``search/cost_model.CostModel.for_device`` loads its ``efficiency`` block. Micro-benchmarks
(GEMM grid, attention, memory copy/add, tiny-op overhead) run in every one of ``nproc`` ranks at
once, so a CPU "device" (one gloo rank) is measured while its siblings share the cores, as in a
real run; then training-step probes (``profile/step_probe.py``); collectives run across the same
ranks (``profile/collectives_bench.py``).

Fits, against the cost model's formulas (``search/pricing/cost_model.py``, :func:`micro_profile`):

* GEMM ``t = (F + h) / P + k`` (log-space least squares): ``P`` the saturated FLOP/s, ``h`` =
  ``matmul_half_flops``, ``k`` the eager per-call time;
* ``attention`` = counted FLOPs (full score matrix, the IR's convention) / time / peak;
* ``memory`` = best streaming bandwidth (copy, add) / HBM bandwidth;
* per link class, ``t = m(p) * S / B + h(p) * alpha + c`` over all collectives and sizes
  (non-negative least squares); ``collective_bandwidth = B / intra_node_bandwidth``.

Then (:func:`apply_step_fits`) the step probes, priced by the cost model under those numbers,
fit ``fb = A / share + N * k``: ``k`` becomes ``kernel_overhead_s`` (the per-kernel cost inside a
real model step, several times the tiny-op chain's) and ``share`` scales the matmul, attention
and memory factors (the sustained in-step rate); Adam over grids of tensors fits
``optimizer_tensor_s`` and ``optimizer_memory``; an overlap probe gives ``comm_overlap``.

Efficiency factors are fractions of the *preset* device's peaks (``cluster.DEVICE_PRESETS``) and
must lie in (0, 1]. Where a measurement exceeds the preset (a CPU rank often beats the preset's
20 GFLOP/s) the factor is capped at 1 and the profile's ``device_overrides`` block holds absolute
numbers that reproduce every measurement. The profile is otherwise the format
``Efficiency.from_profile`` reads, plus ``host``, ``setup``, ``links``, ``fit`` and raw ``tables``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import platform
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from partita.cluster import (
    DEVICE_PRESETS,
    PROFILE_OVERRIDES,
    Cluster,
    DeviceType,
    NodeGroup,
    apply_profile,
    profile_content_hash,
    profile_overrides,
    read_profile,
)
from partita.profile.measure import measure, nnls_fit  # noqa: F401 - re-exported for the benches
from partita.search.pricing.cost_model import PROFILE_FORMAT, PROFILE_VERSION, Efficiency, ProfileError

PROFILER_VERSION = 2  # 2: training-step probes, Adam grid, overlap probe
OVERRIDE_FIELDS = PROFILE_OVERRIDES


# ---- environment --------------------------------------------------------------------------
def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cuda_device_type(name: str, total_memory: float) -> str:
    """Map ``torch.cuda.get_device_name`` (e.g. "NVIDIA H100 80GB HBM3") to a preset device name."""
    up = name.upper()
    gb = total_memory / 1e9
    for key, variants in (
        ("H200", [(0, "H200")]),
        ("H100", [(0, "H100-80G")]),
        ("A100", [(60, "A100-80G"), (0, "A100-40G")]),
        ("V100", [(24, "V100-32G"), (0, "V100-16G")]),
        ("L4", [(0, "L4")]),
        ("T4", [(0, "T4")]),
    ):
        if key in up.replace("-", " ").split() or key in up:
            return next(v for lim, v in variants if gb >= lim)
    return name.replace("NVIDIA ", "").replace(" ", "-")


def host_info(devices: str) -> dict[str, Any]:
    """The identity a profile is keyed by: device type, torch version, CPU model / GPU and driver."""
    import torch

    info: dict[str, Any] = {
        "device_kind": "cpu" if devices == "cpu" else "gpu",
        "torch": torch.__version__,
        "cpu_model": cpu_model(),
        "num_cpus": os.cpu_count() or 1,
        "python": platform.python_version(),
        "cuda": torch.version.cuda,
    }
    if devices == "cpu":
        info |= {"device_type": "CPU", "device_name": cpu_model(), "num_devices": 1}
        return info
    if not torch.cuda.is_available():
        raise ProfileError("`--devices cuda` was asked but torch sees no CUDA device.", "use --devices cpu.")
    props = torch.cuda.get_device_properties(0)
    info |= {
        "device_name": props.name,
        "device_type": cuda_device_type(props.name, props.total_memory),
        "num_devices": torch.cuda.device_count(),
        "capability": f"{props.major}.{props.minor}",
        "driver": _nvidia_driver(),
    }
    return info


def _nvidia_driver() -> str:
    import subprocess

    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=20,
        )  # fmt: skip
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else ""
    except (OSError, subprocess.TimeoutExpired):
        return ""


# ---- fitting ------------------------------------------------------------------------------
def fit_gemm(rows: Sequence[Mapping[str, Any]], dtype: str, overhead_s: float) -> dict[str, float] | None:
    """``t - k = (F + h) / P`` (``k`` = eager per-call overhead), fitted in log space (symmetric
    relative error; robust to the inverted curves of an oversubscribed CPU): for each candidate
    ``h`` the best ``log P`` is a mean, so a 1-D scan over ``h`` is exact enough."""
    import numpy as np

    pts = [(r["flops"], r["median_s"] - overhead_s) for r in rows if r["dtype"] == dtype and r["median_s"] > overhead_s]
    if len(pts) < 2:
        return None
    f = np.array([p[0] for p in pts])
    lt = np.log(np.array([p[1] for p in pts]))
    best = (math.inf, 0.0, 0.0)
    for h in [0.0, *np.logspace(3, 13, 101)]:
        r = np.log(f + h) - lt
        err = float(np.sqrt(np.mean((r - r.mean()) ** 2)))
        if err < best[0] - 1e-9:
            best = (err, float(h), float(np.exp(r.mean())))
    err, h, peak = best
    return {"saturated_flops": peak, "half_flops": h, "log_rms_error": err, "num_points": len(pts)}


def collective_factors(kind: str, p: int) -> tuple[float, float]:
    """(bytes multiplier, hop count) of one collective in the cost model's alpha-beta formula."""
    if kind == "all_reduce":
        return 2 * (p - 1) / p, 2 * (p - 1)
    if kind == "p2p":
        return 1.0, 1.0
    return (p - 1) / p, float(p - 1)


def fit_link(rows: Sequence[Mapping[str, Any]], kinds: Sequence[str]) -> dict[str, float] | None:
    """Fit ``t = m(p) S / B + h(p) alpha + c`` over ``rows`` of the given collective kinds."""
    use = [r for r in rows if r["kind"] in kinds and r["group_size"] > 1]
    if len(use) < 3:
        return None
    design = []
    for r in use:
        m, h = collective_factors(r["kind"], r["group_size"])
        design.append([m * r["bytes"], h, 1.0])
    (inv_bw, alpha, c), err = nnls_fit(design, [r["median_s"] for r in use])
    if inv_bw <= 0:
        return None
    return {
        "bandwidth_Bps": 1.0 / inv_bw,
        "beta_s_per_byte": inv_bw,
        "alpha_s": alpha,
        "fixed_latency_s": c,
        "rel_rms_error": err,
        "num_points": len(use),
        "kinds": list(kinds),
        "group_sizes": sorted({r["group_size"] for r in use}),
    }


def _capped(measured: float, preset: float) -> tuple[float, float]:
    """(efficiency in (0, 1], reference peak) with ``efficiency * reference == measured``."""
    eff = min(1.0, measured / preset) if preset > 0 else 1.0
    eff = max(eff, 1e-6)
    return eff, measured / eff


def build_profile(meas: Mapping[str, Any], host: Mapping[str, Any], setup: Mapping[str, Any]) -> dict[str, Any]:
    """Turn raw tables into the versioned profile (efficiency + overrides + fits + tables): the
    micro-benchmark fits (:func:`micro_profile`), then the training-step fits (:func:`apply_step_fits`)."""
    return apply_step_fits(micro_profile(meas, host, setup))


def micro_profile(meas: Mapping[str, Any], host: Mapping[str, Any], setup: Mapping[str, Any]) -> dict[str, Any]:
    """The profile from the micro-benchmarks alone (GEMM, attention, memory, tiny ops, collectives):
    what the step probes are priced with (``step_probe.probe_terms``)."""
    dev_name = str(host["device_type"])
    preset = DEVICE_PRESETS.get(dev_name) or DeviceType(dev_name, {"bf16": 1.0, "f32": 1.0}, 1.0, 1.0, 1.0)
    base = Efficiency()
    primary = "f32" if host["device_kind"] == "cpu" else "bf16"
    tables = dict(meas)
    overhead = tables.get("overhead", {})
    k = float(overhead.get("autograd_op_s", overhead.get("eager_op_s", base.kernel_overhead_s)))
    k_call = float(overhead.get("eager_op_s", k))
    eff: dict[str, float] = {"kernel_overhead_s": k}
    overrides: dict[str, Any] = {}
    fits: dict[str, Any] = {"gemm": {}, "links": {}}
    gemm = tables.get("gemm", [])
    for dt in sorted({r["dtype"] for r in gemm}):
        f = fit_gemm(gemm, dt, k_call)
        if f:
            fits["gemm"][dt] = f
    prim = fits["gemm"].get(primary) or next(iter(fits["gemm"].values()), None)
    if prim:
        m_eff, ref = _capped(prim["saturated_flops"], preset.flops(primary))
        eff["matmul"] = m_eff
        eff["matmul_half_flops"] = max(prim["half_flops"], 0.0)
        peaks = {dt: f["saturated_flops"] / m_eff for dt, f in fits["gemm"].items()}
        peaks[primary] = ref
        overrides["peak_flops"] = peaks
        att = [r for r in tables.get("attention", []) if r["dtype"] == primary] or tables.get("attention", [])
        if att:
            best = max(r["flops"] / max(r["median_s"] - k_call, 1e-9) for r in att)
            peak_att = peaks.get(att[0]["dtype"], ref)
            eff["attention"] = min(1.0, max(best / peak_att, 1e-6))
            fits["attention"] = {"best_flops_per_s": best, "dtype": att[0]["dtype"]}
    mem = tables.get("memory", [])
    if mem:
        bw = max(r["bytes"] / r["median_s"] for r in mem)
        eff["memory"], overrides["hbm_bandwidth"] = _capped(bw, preset.hbm_bandwidth)
        fits["memory"] = {"best_bandwidth_Bps": bw}
    colls = tables.get("collectives", [])
    link = fit_link(colls, ("all_reduce", "all_gather", "reduce_scatter", "all_to_all"))
    if link:
        eff["collective_bandwidth"], overrides["intra_node_bandwidth"] = _capped(
            link["bandwidth_Bps"], preset.intra_node_bandwidth
        )
        eff["collective_latency_s"] = link["fixed_latency_s"]
        overrides["intra_node_latency"] = link["alpha_s"]
        fits["links"]["intra_node"] = link
        for kind in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all"):
            one = fit_link(colls, (kind,))
            if one:
                fits["links"][f"intra_node/{kind}"] = one
    p2p = fit_link(tables.get("p2p", []), ("p2p",))
    if p2p:
        fits["links"]["intra_node/p2p"] = p2p
    return {
        "format": PROFILE_FORMAT,
        "version": PROFILE_VERSION,
        "profiler_version": PROFILER_VERSION,
        "device": dev_name,
        "efficiency": {name: float(v) for name, v in sorted(eff.items())},
        "device_overrides": overrides,
        "host": dict(host),
        "setup": dict(setup),
        "links": {"intra_node": link} if link else {},
        "fit": fits,
        "tables": tables,
    }


def apply_step_fits(prof: dict[str, Any]) -> dict[str, Any]:
    """Fold the step probes, Adam grid and overlap probe (``profile/step_probe.py``) into ``prof``.

    ``fb = A / share + N * k``: ``k`` replaces the tiny-op ``kernel_overhead_s``, ``share`` scales the
    matmul, attention and memory efficiencies (raising the absolute peaks instead where a factor
    would pass 1); Adam's ``t = n * c + bytes * d`` sets ``optimizer_tensor_s`` and
    ``optimizer_memory``; the overlap probe sets ``comm_overlap``."""
    from partita.profile.step_probe import fit_optimizer, fit_step
    from partita.search.pipeline.stage_cost import StageFactors

    tables, eff, ov, fits = prof["tables"], prof["efficiency"], prof["device_overrides"], prof["fit"]
    preset = DEVICE_PRESETS.get(prof["device"])
    probes = tables.get("step_probe", [])
    step = fit_step(probes)
    scaled = [n for n in ("matmul", "attention", "memory") if n in eff]
    if step and scaled:
        eff["kernel_overhead_s"] = step["kernel_overhead_s"]
        vals = {n: eff[n] * step["sustained_share"] for n in scaled}
        top = max(vals.values())
        if top > 1:  # the probes ran faster than the micro-benchmarks predict
            vals = {n: v / top for n, v in vals.items()}
            if "peak_flops" in ov:
                ov["peak_flops"] = {dt: v * top for dt, v in ov["peak_flops"].items()}
            if "hbm_bandwidth" in ov:
                ov["hbm_bandwidth"] *= top
        eff.update(vals)
        fits["step"] = step
    rows = list(tables.get("optimizer", []))
    rows += [{"num_tensors": r["num_tensors"], "numel": r["numel"], "median_s": r["opt_s"]} for r in probes]
    hbm = ov.get("hbm_bandwidth", preset.hbm_bandwidth if preset else 0.0)
    opt = fit_optimizer(rows, hbm, StageFactors().optimizer_passes)
    if opt:
        eff["optimizer_tensor_s"] = opt["optimizer_tensor_s"]
        if "optimizer_memory" in opt:
            eff["optimizer_memory"] = opt["optimizer_memory"]
        fits["optimizer"] = opt
    if "overlap" in tables:
        eff["comm_overlap"] = float(tables["overlap"]["overlap"])
        fits["overlap"] = dict(tables["overlap"])
    prof["efficiency"] = {name: float(v) for name, v in sorted(eff.items())}
    return prof


# ---- entry point --------------------------------------------------------------------------
def profile(
    devices: str = "cpu", nproc: int = 4, out: str = "profile.json", time_budget_s: float = 240, progress: bool = True
) -> dict[str, Any]:
    """Measure this machine over ``nproc`` local ranks and write the profile to ``out``; return it."""
    from partita.profile.collectives_bench import run_ranks

    if devices not in ("cpu", "cuda"):
        raise ProfileError(f"--devices {devices!r} is not supported.", "use --devices cpu or --devices cuda.")
    if nproc < 1 or time_budget_s <= 0:
        raise ProfileError(f"nproc={nproc} and time_budget_s={time_budget_s} must be positive.", "pass --nproc >= 1.")
    host = host_info(devices)
    if devices == "cuda" and nproc > host["num_devices"]:
        raise ProfileError(
            f"--nproc {nproc} exceeds the {host['num_devices']} visible CUDA devices.",
            f"use --nproc {host['num_devices']} or fewer.",
        )
    # threads per rank as backends/torch/launch.py starts the training ranks: OMP_NUM_THREADS, default 1
    threads = max(1, int(os.environ.get("OMP_NUM_THREADS", "1") or 1)) if devices == "cpu" else 1
    t0 = time.perf_counter()
    tables = run_ranks(devices, nproc, time_budget_s, threads, progress)
    if tables.get("step_probe") and host["device_type"] in DEVICE_PRESETS:  # price them as the planner does
        from partita.profile.step_probe import probe_terms

        prelim = micro_profile(tables, host, {})
        for row, terms in zip(tables["step_probe"], probe_terms(prelim, host["device_type"], tables["step_probe"])):
            row["terms"] = terms
    setup = {
        "nproc": nproc,
        "threads_per_rank": threads,
        "backend": "gloo" if devices == "cpu" else "nccl",
        "time_budget_s": time_budget_s,
        "elapsed_s": round(time.perf_counter() - t0, 2),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    prof = build_profile(tables, host, setup)
    load_profile(prof)  # never write a profile this Partita would refuse
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(prof, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, path)
    return prof


# ---- loading, fingerprint, calibrated devices ---------------------------------------------
def load_profile(profile: str | Path | Mapping[str, Any], device: str | DeviceType | None = None) -> dict[str, Any]:
    """Read and validate a profile (format, versions, device type and kind, efficiency, overrides)."""
    d = read_profile(profile)
    src = "profile" if isinstance(profile, Mapping) else str(profile)
    pv = d.get("profiler_version", PROFILER_VERSION)
    if pv != PROFILER_VERSION:
        raise ProfileError(
            f"{src} was written by profiler version {pv!r}; this Partita reads {PROFILER_VERSION}.",
            "re-run `partita profile` with this version.",
        )
    name = device.name if isinstance(device, DeviceType) else device
    Efficiency.from_profile(d, name)
    dev = device if isinstance(device, DeviceType) else DEVICE_PRESETS.get(str(d.get("device", "")))
    if dev is None:  # a device type that is no preset: check the overrides against a stand-in
        kind = "cpu" if d.get("host", {}).get("device_kind") == "cpu" else "gpu"
        dev = DeviceType(str(d.get("device", "")), {"f32": 1.0}, 1.0, 1.0, 1.0, kind=kind)
    profile_overrides(dev, d, src)
    return d


def profile_fingerprint(path: str | Path | Mapping[str, Any]) -> str:
    """Content hash of what a profile changes in planning (efficiency + overrides), not its path."""
    return profile_content_hash(load_profile(path))


def calibrated_device(device: DeviceType, profile: str | Path) -> DeviceType:
    """``device`` with the profile's absolute ``device_overrides`` applied, ``profile`` and its hash
    set: what a cluster file's ``profile:`` gives (``cluster.apply_profile``), after full validation."""
    load_profile(profile, device)
    return apply_profile(device, profile)


def calibrated_cluster(cluster: Cluster, profile: str | Path) -> Cluster:
    """Every group of the profile's device type calibrated (:func:`calibrated_device`)."""
    name = str(load_profile(profile).get("device"))
    groups = tuple(
        NodeGroup(calibrated_device(g.device, profile), g.num_nodes, g.gpus_per_node) if g.device.name == name else g
        for g in cluster.groups
    )
    if groups == cluster.groups:
        raise ProfileError(f"the profile is for {name}; the cluster has {cluster.describe()}.", "use a matching one.")
    return dataclasses.replace(cluster, groups=groups)
