"""Run logs: what a ``partita run`` measured, beside what its plan predicted (``DIR/run_log.json``).

Written by ``driver.run_plan`` after the launcher returns; read by ``run_log_view.py`` for the
"Predicted vs measured" section of ``partita report DIR``. Pure data (no torch / jax): the input is
the launcher's result dict (``backends/torch/launch.run`` or ``backends/jax/run.run``) and the Plan.

What each framework's result holds, and so what the log can say:

* torch: per-step wall time (the slowest rank per step), losses, collectives per stage and mesh
  axis (``kind@axis``, count and bytes) counted at run time by ``backends/torch/fidelity.CollectiveCounter``
  on each stage's first rank, and the program's own comparison with the plan's records (kinds,
  axes, counts, bytes within 2%). No per-stage times: ``torch_train`` reports the
  max over ranks only, so stage times stay ``None`` and the log lists that gap.
* jax: losses and collectives per stage counted in the compiled HLO (static, per step); no times.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from partita.plan import Plan

RUN_LOG_FILE = "run_log.json"
FORMAT = "partita.report.run_log"
VERSION = 1
_JAX_KINDS = {
    "all-reduce": "all_reduce",
    "all-gather": "all_gather",
    "reduce-scatter": "reduce_scatter",
    "all-to-all": "all_to_all",
    "collective-permute": "p2p",
}


def median(xs: Sequence[float]) -> float | None:
    s = sorted(float(x) for x in xs)
    if not s:
        return None
    n = len(s)
    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2


BYTES_TOL = 0.02  # measured bytes per kind@axis within this fraction of the plan's (issue 15)


def predicted_collectives(plan: Plan) -> dict[int, dict[str, dict[str, float]]]:
    """stage -> ``kind@axis`` -> {count, bytes} per step: the plan's ``Stage.collectives``
    (``search/program/records.py``), the one prediction the torch program also carries."""
    out: dict[int, dict[str, dict[str, float]]] = {}
    for s in plan.stages:
        keys: dict[str, dict[str, float]] = {}
        for c in s.collectives:
            e = keys.setdefault(f"{c.kind}@{c.axis}", {"count": 0, "bytes": 0.0})
            e["count"] += int(c.count)
            e["bytes"] += float(c.bytes) * int(c.count)
        out[s.index] = dict(sorted(keys.items()))
    return out


def mismatch(key: str, pred: Mapping[str, Any] | None, meas: Mapping[str, Any] | None) -> str | None:
    """Why a measured ``kind@axis`` differs from the plan's (counts equal, bytes within :data:`BYTES_TOL`
    where both are known), or None when it matches."""
    pc, mc = int((pred or {}).get("count") or 0), int((meas or {}).get("count") or 0)
    if pc != mc:
        return f"{key}: measured {mc}, predicted {pc}"
    pb, mb = (pred or {}).get("bytes"), (meas or {}).get("bytes")
    if pc and pb and mb is not None and abs(float(mb) - float(pb)) > BYTES_TOL * float(pb):
        return f"{key}: measured {float(mb):.0f} B, predicted {float(pb):.0f} B"
    return None


def _measured_torch(result: Mapping[str, Any]) -> dict[int, dict[str, dict[str, float]]]:
    out = {}
    for key, kinds in (result.get("collectives") or {}).items():
        idx = int(str(key).removeprefix("stage"))
        out[idx] = {k: {"count": int(v.get("count", 0)), "bytes": float(v.get("bytes", 0))} for k, v in kinds.items()}
    return out


def _per_stage(table: Mapping[str, Any]) -> dict[int, dict[str, dict[str, float]]]:
    """``{"stageN": {"kind@axis": {"ops", "bytes"}}}`` (the JAX program's fidelity) by stage index."""
    return {
        int(str(key).removeprefix("stage")): {
            k: {"count": int(v.get("ops", v.get("count", 0))), "bytes": float(v.get("bytes", 0))}
            for k, v in kinds.items()
        }
        for key, kinds in table.items()
    }


def _measured_jax(result: Mapping[str, Any]) -> dict[int, dict[str, dict[str, Any]]]:
    if result.get("collectives"):  # per kind@axis, ops and bytes, with the program's own prediction
        return dict(_per_stage(result["collectives"]))
    out: dict[int, dict[str, dict[str, Any]]] = {}
    for key, counts in (result.get("hlo_collectives") or {}).items():
        kinds = {_JAX_KINDS[k]: {"count": int(counts[k]), "bytes": None} for k in _JAX_KINDS if counts.get(k)}
        out[int(key)] = kinds
    return out


def _devices(plan: Plan) -> dict[str, dict[str, Any]]:
    """Device type -> {kind, profile, num_ranks} for the types the plan's stages use."""
    spec = {g["device"]["name"]: g["device"] for g in plan.cluster.get("spec", {}).get("groups", [])}
    out: dict[str, dict[str, Any]] = {}
    for s in plan.stages:
        for name in set(s.replica_device_types) or {s.device_type}:
            d = spec.get(name, {})
            e = out.setdefault(name, {"kind": d.get("kind"), "profile": d.get("profile"), "num_ranks": 0})
            e["num_ranks"] += len(s.ranks) if not s.replica_device_types else s.tp * s.replica_device_types.count(name)
    return out


def build(
    plan: Plan,
    result: Mapping[str, Any],
    *,
    steps: int,
    framework: str,
    load_before: float | None = None,
) -> dict[str, Any]:
    """The run log for one ``partita run``: predicted vs measured step time and collectives per stage.
    ``load_before``: this machine's 1-minute load average just before the launch (a loaded machine
    is one likely cause of a step-time gap; :func:`gap_causes`)."""
    times = [float(t) for t in result.get("step_time_s") or []]
    predicted_t = plan.predicted.get("step_time_s")
    med = median(times)
    err = (med - float(predicted_t)) / float(predicted_t) if med is not None and predicted_t else None
    measured: dict[int, dict[str, dict[str, Any]]] = dict(
        _measured_jax(result) if framework == "jax" else _measured_torch(result)
    )
    predicted = predicted_collectives(plan)
    runtime_says = bool(result.get("predicted_collectives"))
    if runtime_says:
        # the program carries a prediction and did the comparison itself: torch's is the plan's records
        # (search/program/records.py); JAX's is the plan's records as its program issues them (backends/jax/fidelity.py)
        predicted = _per_stage(result["predicted_collectives"])
    stages = []
    for s in plan.stages:
        pred, meas = predicted.get(s.index, {}), measured.get(s.index)
        kinds = sorted(set(pred) | set(meas or {}))
        rows = {
            k: {"predicted": pred.get(k, {"count": 0, "bytes": 0.0}), "measured": (meas or {}).get(k)} for k in kinds
        }
        mismatches = list((result.get("collective_mismatches") or {}).get(f"stage{s.index}", []))
        for k in kinds if meas is not None and not runtime_says else []:
            why = mismatch(k, pred.get(k), (meas or {}).get(k))
            if why is not None:
                mismatches.append(why)
        stages.append(
            {
                "index": s.index,
                "device_type": s.device_type,
                "ranks": list(s.ranks),
                "mesh": [s.dp, s.tp],
                "predicted_time_s": s.predicted.get("time_s"),
                "measured_time_s": None,
                "collectives": rows,
                "collectives_measured": meas is not None,
                "collective_mismatches": mismatches,
            }
        )
    gaps = ["per-stage step times: the launcher's result has the slowest rank's time per step only"]
    if framework == "jax":
        gaps = [] if times else ["step times: the JAX program reports none"]
        if times:
            gaps.append(
                "step times: the first JAX step includes the jit compilations (the median of 3+ steps skips it)"
            )
    return {
        "format": FORMAT,
        "version": VERSION,
        "framework": framework,
        "model": plan.model.get("name"),
        "cluster": plan.cluster.get("name"),
        "steps": steps,
        "losses": list(result.get("losses") or []),
        "reference_losses": result.get("reference_losses"),
        "step_time_s": {
            "predicted": predicted_t,
            "measured": times,
            "measured_median": med,
            "error": err,  # (measured median - predicted) / predicted
        },
        "collective_source": "hlo" if framework == "jax" else "runtime",
        "stages": stages,
        "gaps": gaps,
        "devices": _devices(plan),
        "machine": {"num_cpus": os.cpu_count(), "load_avg_1m_before": load_before},
        "result": dict(result),
    }


GAP_THRESHOLD = 0.25  # a step-time error beyond this carries its likely causes and fixes


def gap_causes(log: Mapping[str, Any]) -> list[tuple[str, str]]:
    """(likely cause, command or step that fixes it) for a predicted-vs-measured step-time gap over
    :data:`GAP_THRESHOLD`; empty when the gap is smaller or nothing was measured. Reads only the log,
    so a log from an older Partita (without ``devices`` / ``machine``) still gets an answer."""
    err = (log.get("step_time_s") or {}).get("error")
    if err is None or abs(float(err)) <= GAP_THRESHOLD:
        return []
    plan_dir = str(log.get("plan_dir") or "DIR")
    world = sum(len(s.get("ranks", [])) for s in log.get("stages", [])) or 1
    devices = log.get("devices") or {s.get("device_type"): {} for s in log.get("stages", [])}
    machine = log.get("machine") or {}
    causes: list[tuple[str, str]] = []
    for name, d in devices.items():
        if d.get("profile"):
            continue
        flag = "cpu" if (d.get("kind") or ("cpu" if str(name).upper() == "CPU" else "gpu")) == "cpu" else "cuda"
        n, out = int(d.get("num_ranks") or world), f"profile-{str(name).lower()}.json"
        causes.append(
            (
                f"no calibration profile for {name}: the prediction uses its datasheet numbers, not this machine's",
                f"`partita profile --devices {flag} --nproc {n} --out {out}` on a {name} machine, add `profile: {out}`"
                f" to the {name} node of a cluster file, and recompile with that file and --force",
            )
        )
    cpus, load = machine.get("num_cpus"), machine.get("load_avg_1m_before")
    cpu_ranks = sum(int(d.get("num_ranks") or 0) for d in devices.values() if d.get("kind") == "cpu")
    if cpus and cpu_ranks > int(cpus):
        causes.append(
            (
                f"{cpu_ranks} CPU ranks shared {cpus} cores, so they ran in turn, not in parallel",
                f"run on a machine with at least {cpu_ranks} cores, or plan for {cpus} ranks "
                f"(`partita compile ... --cluster {cpus}xCPU`)",
            )
        )
    if cpus and load is not None and float(load) > 0.5 * int(cpus):
        causes.append(
            (
                f"a loaded machine: load average {float(load):.1f} on {cpus} cores before the run",
                f"rerun when the machine is idle: `partita run {plan_dir}`",
            )
        )
    elif load is None:
        causes.append(
            (
                "possibly a loaded machine (this run did not record the load)",
                f"check `uptime`, then rerun when idle: `partita run {plan_dir}`",
            )
        )
    if not causes:
        causes.append(
            (
                "the calibration profile does not describe this machine now (another host, other thread counts)",
                "re-measure it with `partita profile` on this machine and recompile with --force",
            )
        )
    return causes


def write(plan_dir: str | Path, log: Mapping[str, Any]) -> Path:
    path = Path(plan_dir) / RUN_LOG_FILE
    tmp = path.with_name(path.name + ".tmp")
    log = {**log, "plan_dir": str(plan_dir)}
    tmp.write_text(json.dumps(log, indent=1, sort_keys=True, default=str) + "\n")
    tmp.replace(path)
    return path


def load(plan_dir: str | Path) -> dict[str, Any] | None:
    """The run log next to a plan, or None when there is none (or it is not a run log)."""
    path = Path(plan_dir) / RUN_LOG_FILE if Path(plan_dir).is_dir() else Path(plan_dir).with_name(RUN_LOG_FILE)
    if not path.exists():
        return None
    try:
        log = json.loads(path.read_text())
    except ValueError:
        return None
    return log if isinstance(log, dict) and log.get("format") == FORMAT else None
