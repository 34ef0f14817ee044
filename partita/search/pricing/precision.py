"""Training precision per plan, and why a device type sits idle: read by the planner and the plan builder.

Sits beside ``search/pricing/config.py``: :func:`choose_precision` runs once at the start of
``planner.plan_graph``. V100 and T4 have fp16 tensor cores but no bf16 ones (``cluster.DEVICE_PRESETS``
prices their bf16 at the fp32 rate), so a bf16 plan on a mixed cluster leaves them nearly useless;
fp16 with dynamic loss scaling runs at full tensor-core speed on every GPU here (on A100/H100 fp16
and bf16 have the same peak). The rule: a bf16 request becomes fp16 when some device type of the
cluster has a higher fp16 than bf16 peak and none has a lower one, and ``SearchOptions.allow_f16``
is on. The plan records ``training.dtype == "f16"`` and the reason (``predicted.precision``); the
runtime must then scale the loss dynamically (fp16 gradients underflow without it).

:func:`idle_reasons` says, per device type a plan leaves (partly) idle, the numbers behind it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from partita.cluster import Cluster, DeviceType
from partita.search.pricing.config import TrainingConfig


def _gain(dev: DeviceType) -> float:
    """fp16 peak over bf16 peak (1.0 on GPUs with bf16 tensor cores)."""
    bf = dev.flops("bf16")
    return dev.flops("f16") / bf if bf else 1.0


def choose_precision(cluster: Cluster, training: TrainingConfig, allow_f16: bool = True) -> TrainingConfig:
    """``training`` with ``dtype="f16"`` when that lets older GPUs contribute (module docstring)."""
    if not allow_f16 or training.dtype != "bf16":
        return training
    gains = [_gain(d) for d in cluster.device_types() if d.kind == "gpu"]
    if gains and max(gains) > 1.0 and min(gains) >= 1.0:
        return dataclasses.replace(training, dtype="f16")
    return training


def precision_note(cluster: Cluster, dtype: str) -> str:
    """Why the plan trains in ``dtype``, with the device types it matters for."""
    slow = [d for d in cluster.device_types() if d.kind == "gpu" and _gain(d) > 1.0]
    if dtype == "f16" and slow:
        names = ", ".join(f"{d.name} ({d.flops('bf16') / 1e12:g} -> {d.flops('f16') / 1e12:g} TFLOP/s)" for d in slow)
        return f"fp16 with dynamic loss scaling: {names} have no bf16 tensor cores; fp16 peaks equal bf16 elsewhere"
    if dtype == "bf16" and slow:
        names = ", ".join(d.name for d in slow)
        return f"bf16 as requested: {names} run it at their fp32 rate (no bf16 tensor cores); fp16 would not"
    return f"{dtype} as requested"


def idle_reasons(cluster: Cluster, used: Mapping[str, int], dtype: str) -> dict[str, str]:
    """Per device type with idle devices: how many, and the peak / memory numbers behind it."""
    types = cluster.device_types()
    best = max(types, key=lambda d: d.flops(dtype))
    out = {}
    for d in types:
        idle = cluster.count(d.name) - used.get(d.name, 0)
        if idle <= 0:
            continue
        why = f"{idle} of {cluster.count(d.name)} idle; {d.flops(dtype) / 1e12:g} TFLOP/s {dtype} per device"
        if _gain(d) > 1.0 and dtype == "bf16":
            why += f" (no bf16 tensor cores: fp16 would give {d.flops('f16') / 1e12:g})"
        if d.name != best.name:
            why += f" vs {best.flops(dtype) / 1e12:g} on {best.name}"
        why += f", {d.memory_bytes / 1e9:g} GB: every plan the search priced with them was slower or did not fit"
        out[d.name] = why
    return out
