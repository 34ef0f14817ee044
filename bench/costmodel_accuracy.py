"""Cost-model accuracy on 109 measured Megatron iterations (A100-80G clusters, vTrain's ground truth).

Every row of ``partita/data/a100_megatron_measured.csv`` is priced the way ``partita evaluate``
prices it: the cluster is the shorthand ``{gpus}xA100-80G`` read by ``cluster.parse_cluster`` (the
DGX A100 reference node: 8 GPUs, NVLink, 8 x 200 Gb/s; the shipped A100 calibration applied by
default), the model is Megatron-LM's 2021 GPT (``bench/megatron_gpt.py``, traced once), and
``search.evaluate.evaluate_config`` prices the row's tp / pp / dp / micro-batch with full activation
recompute, as Megatron ran these sizes.

Calibration = coordinate descent over a few ``Efficiency`` factors (``CANDIDATES``), minimizing
the mean over model sizes of (median + mean) abs error / 2 on the rows it is given (``objective``). Three protocols:

* ``shipped``: fitted on all 109 rows and written to ``partita/data/a100_megatron_calibration.json``
  (what users get by default); its error on the same rows is *in-sample*;
* ``lomso`` (leave one model size out): fitted on three sizes, predicting the fourth, for each size:
  the held-out test of "does it generalize to a model it was not fitted on";
* ``loo`` (leave one row out): fitted on the other 108 rows, predicting the one left out.

Reports median and mean abs error overall and per size, Spearman, the worst rows with their time
breakdown and whether the row contradicts a matched twin (``matched_pairs``), and the published
mark beside ours. Writes ``bench/results/costmodel_accuracy.json``. ``--quick`` skips ``loo``.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import hashlib
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from gpt_graphs import gpt_graph  # noqa: E402

from partita.cluster import Cluster, parse_cluster  # noqa: E402
from partita.ir import Graph  # noqa: E402
from partita.search.entry.evaluate import Evaluation, evaluate_config  # noqa: E402
from partita.search.pipeline.stage_cost import SolverCosts  # noqa: E402
from partita.search.pricing.config import TrainingConfig  # noqa: E402
from partita.search.pricing.cost_model import CostModel, Efficiency  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CSV = ROOT / "partita" / "data" / "a100_megatron_measured.csv"
PROFILE = ROOT / "partita" / "data" / "a100_megatron_calibration.json"
OUT = ROOT / "bench" / "results" / "costmodel_accuracy.json"
# vTrain (MICRO 2024) on these rows; the 3-4% mark is what published simulators report on their
# own validation sets (issue 18's target to aim at), not on this data.
PUBLISHED = {"vTrain on these 109 rows (mean)": 0.1473, "published simulators, own validation sets (mean)": 0.035}


def load_rows() -> list[dict]:
    rows = []
    with CSV.open() as f:
        for i, r in enumerate(csv.DictReader(f)):
            key = f"{i}:" + ",".join(r.values())
            rows.append(
                {
                    "index": i,
                    "params_b": float(r["Parameters (billion)"]),
                    "gpus": int(r["# GPUs"]),
                    "global_batch": int(r["global batch"]),
                    "micro_batch": int(r["micro batch"]),
                    "hidden": int(r["hidden size"]),
                    "heads": int(r["attention heads"]),
                    "layers": int(r["# layers"]),
                    "seq": int(r["sequence length"]),
                    "tp": int(r["tensor parallelism"]),
                    "dp": int(r["data parallelism"]),
                    "pp": int(r["pipeline parallelism"]),
                    "measured_s": float(r["iteration time (ms)"]) / 1e3,
                    "split": "train" if int(hashlib.sha256(key.encode()).hexdigest(), 16) % 2 == 0 else "test",
                }
            )
    return rows


_GRAPHS: dict[tuple, Graph] = {}
_COSTS: dict[tuple, SolverCosts] = {}


def graph(r: dict) -> Graph:
    dims = (r["hidden"], r["heads"], r["layers"], r["seq"])
    if dims not in _GRAPHS:
        _GRAPHS[dims] = gpt_graph(*dims, megatron_2021=True)
    return _GRAPHS[dims]


def cluster(num_gpus: int, calibrated: bool = True) -> Cluster:
    """What ``partita evaluate --cluster {num_gpus}xA100-80G`` reads."""
    return parse_cluster(f"{num_gpus}xA100-80G", calibrated=calibrated)


def evaluate_row(r: dict, eff: Efficiency | None = None) -> Evaluation:
    """One row through ``evaluate_config``; ``eff`` None = the shipped defaults (the CLI's path),
    else the uncalibrated preset priced with ``eff`` (fitting)."""
    cl = cluster(r["gpus"], calibrated=eff is None)
    tr = TrainingConfig(global_batch=r["global_batch"], seq_len=r["seq"])
    g = graph(r)
    key = (id(g), r["gpus"], eff)
    if key not in _COSTS:
        _COSTS[key] = SolverCosts(g, cl, tr, tp_style="megatron")
        dev = cl.groups[0].device
        # the shipped device factors with the program's own (PROGRAM_FACTORS), as the profile records them
        used = (
            eff if eff is not None else dataclasses.replace(CostModel.for_device(dev).efficiency, **program_factors())
        )
        _COSTS[key]._cm[dev.name] = CostModel(dev, used)
    costs = _COSTS[key]
    costs.training = tr  # the layer solves depend on seq, dtype and optimizer only
    return evaluate_config(
        g, cl, tr, tp=r["tp"], pp=r["pp"], dp=r["dp"], micro_batch=r["micro_batch"], recompute="full", costs=costs
    )


_PRED: dict[tuple, float] = {}


def predict(rows: list[dict], eff: Efficiency | None = None) -> list[float]:
    """Predicted step seconds per row (memoized per (row, efficiency): fits revisit points)."""
    out = []
    for r in rows:
        key = (r["index"], eff)
        if key not in _PRED:
            _PRED[key] = evaluate_row(r, eff).predicted_step_time_s
        out.append(_PRED[key])
    return out


def spearman(a: list[float], b: list[float]) -> float:
    ra, rb = np.argsort(np.argsort(a)), np.argsort(np.argsort(b))
    return float(np.corrcoef(ra, rb)[0, 1]) if len(a) > 2 else float("nan")


def metrics(rows: list[dict], pred: list[float]) -> dict:
    meas = [r["measured_s"] for r in rows]
    err = [abs(p - m) / m for p, m in zip(pred, meas)]
    return {
        "n": len(rows),
        "median_abs_err": float(np.median(err)),
        "mean_abs_err": float(np.mean(err)),
        "spearman": spearman(pred, meas),
    }


# Coordinate descent over these values, starting from the first of each list; two sweeps.
# ``attention`` is tied to ``0.8 * matmul``; ``comm_overlap`` is the share of the last backward that hides the
# data-parallel gradient sync *in the program these rows ran* (Megatron-DeepSpeed; Megatron-LM of 2021 all-reduced
# after the backward): fitted with the rest because it prices these rows, but a trait of that program, not of
# the A100 (PROGRAM_FACTORS).
CANDIDATES: dict[str, list[float]] = {
    "matmul": [0.85, 0.75, 0.8, 0.9, 0.95],
    "collective_bandwidth": [0.7, 0.5, 0.6, 0.85, 1.0],
    "network_bandwidth": [0.6, 0.3, 0.4, 0.5, 0.8],
    # the saturation knee stays at the default: the rows hold only large GEMMs, so a fitted knee
    # would extrapolate to small models and make A100 incomparable with uncalibrated device types
    "matmul_half_flops": [2e9],
    "memory": [0.8, 0.6, 0.9],
    "pointwise_fusion": [1.0, 0.5, 0.0],  # Megatron-LM's hand-fused kernels
    "comm_overlap": [1.0, 0.5, 0.0],
}
# Fitted factors that describe the program the rows ran, not the device: the shipped profile keeps their GPU
# defaults in ``efficiency`` (so Partita's FSDP2 plans on A100 hide their reduce-scatters under the backward,
# as FSDP runs them) and records the fitted values under ``program``, which prices only these rows (issue 32:
# fitted into the device factors, ``comm_overlap = 0`` priced every FSDP reduce-scatter on A100 exposed).
PROGRAM_FACTORS = ("comm_overlap",)


def program_factors() -> dict[str, float]:
    """The fitted program factors the shipped profile records (``PROGRAM_FACTORS``), {} before the first fit."""
    d = json.loads(PROFILE.read_text()) if PROFILE.exists() else {}
    return {k: float(v) for k, v in d.get("program", {}).get("factors", {}).items() if k in PROGRAM_FACTORS}


def matched_pairs(rows: list[dict]) -> list[dict]:
    """Pairs of rows of one model that differ only in how tp splits the same per-GPU work.

    Same pp, same number of micro-batches (so the same pipeline bubble) and the same micro-batch
    per tp rank (``micro_batch / tp``), so both run the same per-GPU GEMM FLOPs per slot. The
    larger-tp row can only add cost (more and larger tp collectives, narrower GEMMs) minus a
    smaller DP gradient per GPU, so any cost model built from compute and communication ranks it
    at or above the smaller-tp row. ``ratio`` = larger-tp time / smaller-tp time; a ratio well
    below 1 is an inversion no such model reproduces.
    """
    out = []
    for i, a in enumerate(rows):
        for b in rows[i + 1 :]:
            if a["params_b"] != b["params_b"] or a["pp"] != b["pp"] or a["tp"] == b["tp"]:
                continue
            lo, hi = (a, b) if a["tp"] < b["tp"] else (b, a)
            m_lo = lo["global_batch"] // (lo["dp"] * lo["micro_batch"])
            m_hi = hi["global_batch"] // (hi["dp"] * hi["micro_batch"])
            if m_lo != m_hi or lo["micro_batch"] * hi["tp"] != hi["micro_batch"] * lo["tp"]:
                continue
            out.append(
                {
                    "params_b": lo["params_b"],
                    "pp": lo["pp"],
                    "micro_batches": m_lo,
                    "small_tp": (lo["tp"], lo["micro_batch"], lo["measured_s"]),
                    "large_tp": (hi["tp"], hi["micro_batch"], hi["measured_s"]),
                    "ratio": hi["measured_s"] / lo["measured_s"],
                }
            )
    return out


INVERSION = 0.9  # the larger-tp row measures >10% faster than the smaller-tp one (noise is ~3%)


def consistency(rows: list[dict]) -> dict[str, dict]:
    """Per model size: matched pairs, inversions, and the worst one (``matched_pairs``)."""
    res = {}
    pairs = matched_pairs(rows)
    for size in sorted({r["params_b"] for r in rows}):
        mine = [p for p in pairs if p["params_b"] == size]
        inv = [p for p in mine if p["ratio"] < INVERSION]
        worst = min(mine, key=lambda p: p["ratio"]) if mine else None
        res[f"{size}B"] = {"pairs": len(mine), "inversions": len(inv), "worst": worst}
    return res


def objective(rows: list[dict], pred: list[float]) -> float:
    """Mean over model sizes of (median + mean) abs error / 2, on the given rows.

    The median is the per-size target; the mean is the statistic published simulators report (and
    the one a cluster of badly priced rows moves). Fitting the median alone left the six tp=16 rows
    (tp collectives across two nodes) 70-95% over their measurement at a network efficiency of 0.4,
    which their own timing contradicts: their measured step minus the predicted compute leaves about
    2 ms per 16-GPU all-reduce of 201 MB (six per layer and micro-batch), what eight rail NICs of
    25 GB/s give at line rate; the mean makes the fit see them."""
    sizes = sorted({r["params_b"] for r in rows})
    per = [
        metrics([r for r in rows if r["params_b"] == s], [p for r, p in zip(rows, pred) if r["params_b"] == s])
        for s in sizes
    ]
    return float(np.mean([(m["median_abs_err"] + m["mean_abs_err"]) / 2 for m in per]))


def efficiency(values: dict[str, float]) -> Efficiency:
    return Efficiency(**values, attention=0.8 * values["matmul"], device="A100-80G")


def fit(train: list[dict], sweeps: int = 2) -> tuple[Efficiency, float]:
    cur = {k: v[0] for k, v in CANDIDATES.items()}

    def score(values: dict[str, float]) -> float:
        return objective(train, predict(train, efficiency(values)))

    best = score(cur)
    for _sweep in range(sweeps):
        moved = False
        for name, options in CANDIDATES.items():
            for v in options:
                trial = cur | {name: v}
                err = score(trial)
                if err < best - 1e-9:
                    best, cur, moved = err, trial, True
        if not moved:
            break
    return efficiency(cur), best


def per_size(rows: list[dict], pred: list[float]) -> dict[str, dict]:
    out = {}
    for size in sorted({r["params_b"] for r in rows}):
        idx = [i for i, r in enumerate(rows) if r["params_b"] == size]
        out[f"{size}B"] = metrics([rows[i] for i in idx], [pred[i] for i in idx])
    return out


def worst_rows(rows: list[dict], pred: list[float], k: int = 6) -> list[dict]:
    """The ``k`` largest errors, each with its layout, the predicted breakdown (shipped defaults)
    and the matched twin it contradicts, if any."""
    pairs = matched_pairs(rows)
    order = sorted(range(len(rows)), key=lambda i: -abs(pred[i] - rows[i]["measured_s"]) / rows[i]["measured_s"])
    out = []
    for i in order[:k]:
        r = rows[i]
        ev = evaluate_row(r)
        twins = [
            p
            for p in pairs
            if p["params_b"] == r["params_b"]
            and r["measured_s"] in (p["small_tp"][2], p["large_tp"][2])
            and p["ratio"] < INVERSION
        ]
        why = []
        if twins:
            w = min(twins, key=lambda p: p["ratio"])
            why.append(
                f"in an inverted matched pair: tp{w['large_tp'][0]} measured {w['ratio']:.2f}x the time of "
                f"tp{w['small_tp'][0]} for the same per-GPU work (no compute+communication model ranks that)"
            )
        if r["tp"] > 8:
            why.append(f"tp={r['tp']} spans {r['tp'] // 8} nodes: tp collectives priced over the network")
        parts = {"pipeline_s": ev.pipeline_s, "bubble_s": ev.bubble_s, "tail_s": ev.tail_s}
        out.append(
            {
                "index": r["index"],
                "row": f"{r['params_b']}B tp{r['tp']} pp{r['pp']} dp{r['dp']} mb{r['micro_batch']} gb{r['global_batch']}",
                "measured_s": r["measured_s"],
                "predicted_s": pred[i],
                "err": (pred[i] - r["measured_s"]) / r["measured_s"],
                "breakdown": parts,
                "why": why or ["no matched-pair contradiction; see breakdown"],
            }
        )
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="skip leave-one-row-out (109 refits)")
    ap.add_argument("--no-write-profile", action="store_true", help="do not overwrite the shipped profile")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    rows = load_rows()
    res: dict[str, Any] = {"n": len(rows), "published": PUBLISHED}
    res["uncalibrated"] = metrics(rows, predict(rows, Efficiency(device="A100-80G")))

    # LOMSO: fit on three sizes, predict the fourth.
    sizes = sorted({r["params_b"] for r in rows})
    lomso_pred = [0.0] * len(rows)
    res["lomso"] = {"per_size": {}, "fitted": {}}
    for s in sizes:
        train = [r for r in rows if r["params_b"] != s]
        eff, _ = fit(train)
        held = [i for i, r in enumerate(rows) if r["params_b"] == s]
        for i, p in zip(held, predict([rows[i] for i in held], eff)):
            lomso_pred[i] = p
        res["lomso"]["per_size"][f"{s}B"] = metrics([rows[i] for i in held], [lomso_pred[i] for i in held])
        res["lomso"]["fitted"][f"{s}B"] = {k: getattr(eff, k) for k in CANDIDATES}
        print(f"  lomso {s}B: {res['lomso']['per_size'][f'{s}B']}", flush=True)
    res["lomso"]["all"] = metrics(rows, lomso_pred)

    # Shipped: fit on all rows, write the profile, predict through the CLI's default path.
    eff, _ = fit(rows)
    device_only = dataclasses.replace(eff, **{k: getattr(Efficiency(), k) for k in PROGRAM_FACTORS})
    profile = device_only.to_profile() | {
        "applies_to": ["A100-40G"],
        "fitted_on": "all 109 rows of a100_megatron_measured.csv (bench/costmodel_accuracy.py; held-out: lomso, loo)",
        "program": {
            "name": "Megatron-DeepSpeed, the rows of a100_megatron_measured.csv",
            "factors": {k: getattr(eff, k) for k in PROGRAM_FACTORS},
            "note": "fitted with the device factors; prices only these rows (bench/costmodel_accuracy.py): "
            "a trait of that program, so efficiency keeps the GPU defaults",
        },
    }
    if not args.no_write_profile:
        PROFILE.write_text(json.dumps(profile, indent=1, sort_keys=True) + "\n")
        from partita import cluster as _cl

        _cl._SHIPPED.clear()  # re-read the profile just written
    shipped = [evaluate_row(r).predicted_step_time_s for r in rows]
    res["shipped"] = metrics(rows, shipped) | {"per_size": per_size(rows, shipped), "in_sample": True}
    # the profile that priced these rows: the fit just written, or (--no-write-profile) the one shipped
    if args.no_write_profile:
        from partita.cluster import parse_cluster
        from partita.search.pricing.cost_model import CostModel

        used = CostModel.for_device(parse_cluster("8xA100-80G").groups[0].device).efficiency
    else:
        used = device_only
    # the device factors the CLI applies, and apart from them the program factors that priced these rows
    res["shipped"]["profile"] = {k: getattr(used, k) for k in CANDIDATES}
    res["shipped"]["program"] = program_factors() if args.no_write_profile else profile["program"]["factors"]
    if args.no_write_profile:  # what a refit on all rows would ship (not shipped: --no-write-profile)
        res["shipped"]["refit_profile"] = {k: getattr(eff, k) for k in CANDIDATES}

    res["consistency"] = consistency(rows)
    res["worst"] = worst_rows(rows, shipped)
    res["rows"] = [{**r, "predicted_s": p, "lomso_predicted_s": q} for r, p, q in zip(rows, shipped, lomso_pred)]
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(res | {"time_s": time.perf_counter() - t0}, indent=1, sort_keys=True) + "\n")
    print_table(res | {"time_s": time.perf_counter() - t0})
    if not args.quick:
        loo_pred = []
        for i, r in enumerate(rows):
            e, _ = fit(rows[:i] + rows[i + 1 :])
            loo_pred.append(predict([r], e)[0])
            if i % 10 == 9:
                print(f"  loo {i + 1}/{len(rows)} rows", flush=True)
        res["loo"] = metrics(rows, loo_pred) | {"per_size": per_size(rows, loo_pred)}
        res["time_s"] = time.perf_counter() - t0
        OUT.write_text(json.dumps(res, indent=1, sort_keys=True) + "\n")
        print_table(res)
    return res


def print_table(res: dict) -> None:
    print(f"{'protocol':<34} {'size':<7} {'n':>3} {'median err':>10} {'mean err':>9} {'spearman':>8}")

    def line(name: str, size: str, m: dict) -> None:
        print(
            f"{name:<34} {size:<7} {m['n']:>3} {m['median_abs_err']:>10.1%} {m['mean_abs_err']:>9.1%} "
            f"{m['spearman']:>8.3f}"
        )

    line("uncalibrated preset", "all", res["uncalibrated"])
    for size, m in res["shipped"]["per_size"].items():
        line("shipped defaults (in-sample)", size, m)
    line("shipped defaults (in-sample)", "all", res["shipped"])
    for size, m in res["lomso"]["per_size"].items():
        line("leave-one-model-size-out", size, m)
    line("leave-one-model-size-out", "all", res["lomso"]["all"])
    if "loo" in res:
        for size, m in res["loo"]["per_size"].items():
            line("leave-one-row-out", size, m)
        line("leave-one-row-out", "all", res["loo"])
    for name, v in res["published"].items():
        print(f"{name:<60} mean {v:.1%}")
    print("worst rows (shipped defaults):")
    for w in res["worst"]:
        print(
            f"  {w['row']:<40} measured {w['measured_s']:7.2f} s predicted {w['predicted_s']:7.2f} s ({w['err']:+.0%})"
        )
        for why in w["why"]:
            print(f"      {why}")
    print("matched pairs (same pp, micro-batches and per-GPU work; larger tp / smaller tp, <0.9 = inversion):")
    for name, c in res["consistency"].items():
        print(f"  {name:<7} {c['pairs']:>3} pairs {c['inversions']:>3} inversions")
    print(f"time {res['time_s']:.0f} s")


if __name__ == "__main__":
    main()
