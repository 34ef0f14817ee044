"""Calibration benchmark: predicted vs measured step time of real CPU runs, before and after profiling.

For small GPT-2 and Llama models (the zoo's tiny ones, and "mini" variants written as HF
``config.json`` files so the spawned training ranks resolve them too), each plan is either the
planner's own choice (``Traced.plan``) or a fixed DP / TP / PP / DPxTP layout priced with the
planner's cost path (the Candidate that ``search/evaluate.evaluate_config`` builds, turned into a
Plan by ``search/plan_build.build_plan``). Each plan is compiled to a directory and trained with
``runtime/torch_launch.run``; its predicted step time is taken three ways:

* ``uncal``: the preset CPU device type with default ``Efficiency()`` (GPU-typical factors);
* ``plain``: ``DeviceType.profile = PROFILE`` only (what a cluster YAML ``profile:`` gives today);
* ``cal``: ``runtime/profiler.calibrated_device`` (efficiency + the profile's absolute overrides).

Measured = median step time after the first step, over ``--repeats`` launches (spread reported:
several agents share this 2-core machine, so CPU timing is noisy). Writes
``bench/results/calibration.json`` and prints a table. Usage::

    python bench/calibration.py [--profile partita/data/profiles/cpu-4rank-example.json] [--repeats 2]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from partita.cluster import Cluster, NodeGroup, parse_shorthand
from partita.compiler.driver import Traced, _write_outputs, trace_handle
from partita.models import resolve_model
from partita.plan import Plan
from partita.runtime.profiler import calibrated_cluster
from partita.search import schedule as sched
from partita.search.config import SearchOptions, TrainingConfig
from partita.search.evaluate import megatron_split
from partita.search.plan_build import Candidate, StagePick, build_plan
from partita.search.planner import Option, Search

ROOT = Path(__file__).resolve().parents[1]
PROFILE = ROOT / "partita" / "data" / "profiles" / "cpu-4rank-example.json"
OUT = ROOT / "bench" / "results" / "calibration.json"
MINI = {
    "gpt2-mini": {"model_type": "gpt2", "n_embd": 256, "n_layer": 4, "n_head": 4, "vocab_size": 1024,
                  "n_positions": 128},
    "llama-mini": {"model_type": "llama", "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4,
                   "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1024,
                   "max_position_embeddings": 128},
}  # fmt: skip
# (model, layout or "search", world size, global batch, seq)
CASES: list[tuple[str, Any, int, int, int]] = [
    ("gpt2-tiny", "search", 2, 8, 32),
    ("llama-tiny", "search", 4, 8, 32),
    ("gpt2-mini", {"dp": 4, "tp": 1, "pp": 1, "b": 2}, 4, 8, 128),
    ("gpt2-mini", {"dp": 1, "tp": 2, "pp": 1, "b": 4}, 2, 8, 128),
    ("gpt2-mini", {"dp": 1, "tp": 1, "pp": 2, "b": 2}, 2, 8, 128),
    ("gpt2-mini", {"dp": 2, "tp": 2, "pp": 1, "b": 2}, 4, 8, 128),
    ("llama-mini", {"dp": 2, "tp": 1, "pp": 1, "b": 2}, 2, 8, 128),
    ("llama-mini", {"dp": 1, "tp": 2, "pp": 1, "b": 4}, 2, 8, 128),
    ("llama-mini", {"dp": 1, "tp": 1, "pp": 2, "b": 2}, 2, 8, 128),
]


def fixed_candidate(search: Search, dp: int, tp: int, pp: int, b: int, schedule: str = "1f1b") -> Candidate:
    """The Megatron-style candidate ``evaluate_config`` prices (even block split, ZeRO 0, no recompute)."""
    dev = search.cluster.device_types()[0]
    m = search.training.global_batch // (b * dp)
    in_flight = np.array([0.0] + [sched.in_flight(schedule, 0, s, m, 1) for s in range(1, pp + 1)])
    got = search.arrays(((dev, dp, b),), dp, tp, in_flight, sched.p2p_multiplier(schedule, 1))
    if got is None:
        raise RuntimeError(f"tp={tp} is infeasible for {search.graph.name}")
    per_combo, best, pick, combos = got
    opt = Option(0, tp, tp, ((dev, dp, b),), (), per_combo, combos, best, pick)
    picks = tuple(StagePick(a, c, opt, 0) for a, c in megatron_split(search.graph, pp))
    return Candidate(dp, b, m, schedule, 1, picks, search)


def layout_of(plan: Plan) -> dict[str, int] | None:
    """The (dp, tp, pp, b) of a plan whose stages are uniform, else None."""
    s0 = plan.stages[0]
    if any((s.dp, s.tp) != (s0.dp, s0.tp) for s in plan.stages) or plan.num_virtual_stages != 1:
        return None
    return {"dp": s0.dp, "tp": s0.tp, "pp": plan.num_stages, "b": plan.micro_batch_size}


def predict(graph: Any, cluster: Cluster, training: TrainingConfig, lay: dict[str, int], schedule: str) -> float:
    opts = SearchOptions(zero_stages=(0,), recompute=("none",), max_layer_units=0, max_tp=lay["tp"])
    return fixed_candidate(Search(graph, cluster, training, opts), **lay, schedule=schedule).step_time


def plain_cluster(world: int, profile: Path) -> Cluster:
    base = parse_shorthand(f"{world}xCPU")
    g = base.groups[0]
    return dataclasses.replace(
        base, groups=(NodeGroup(dataclasses.replace(g.device, profile=str(profile)), g.num_nodes, g.gpus_per_node),)
    )


def measure(plan_dir: Path, steps: int, repeats: int) -> dict[str, Any]:
    """Median step time (first step dropped) per launch; the first launch also counts collectives."""
    from partita.runtime.torch_launch import run

    medians, walls, counts = [], [], {}
    for rep in range(repeats):
        t0 = time.perf_counter()
        res = run(plan_dir, steps=steps, extra_args=() if rep == 0 else ("--no-count",))
        walls.append(time.perf_counter() - t0)
        medians.append(statistics.median(res["step_time_s"][1:]))
        if rep == 0:
            counts = {"measured": res.get("collectives", {}), "predicted": res.get("predicted_collectives", {})}
    return {
        "median_s": statistics.median(medians),
        "per_launch_s": medians,
        "spread": (max(medians) - min(medians)) / statistics.median(medians),
        "launch_wall_s": walls,
        "collectives": counts,
    }


def extra_call_latency(plan: Plan, counts: dict[str, Any], link: dict[str, float]) -> float:
    """Diagnostic: latency of the collective calls the runtime issues beyond those the plan prices
    (e.g. one all-reduce per gradient tensor against one bucketed all-reduce), from the profile's
    alpha and fixed latency; the max over stages (they run concurrently)."""
    from partita.runtime.profiler import collective_factors

    worst = 0.0
    for st in plan.stages:
        key = f"stage{st.index}"
        meas, pred = counts.get("measured", {}).get(key, {}), counts.get("predicted", {}).get(key, {})
        p = st.dp if st.tp == 1 else (st.tp if st.dp == 1 else max(st.dp, st.tp))
        extra = 0.0
        for kind in set(meas) | set(pred):
            if kind not in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all") or p < 2:
                continue
            n = meas.get(kind, {}).get("count", 0) - pred.get(kind, {}).get("count", 0)
            extra += n * (collective_factors(kind, p)[1] * link["alpha_s"] + link["fixed_latency_s"])
        worst = max(worst, extra)
    return worst


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", default=str(PROFILE))
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--only", default="", help="comma-separated case indices")
    ap.add_argument("--out", default=str(OUT))
    ap.add_argument("--no-match-nproc", dest="match_nproc", action="store_false", help="one profile for all")
    args = ap.parse_args(argv)
    profile = Path(args.profile).resolve()
    rows: list[dict[str, Any]] = []
    graphs: dict[tuple[str, int], Any] = {}
    with tempfile.TemporaryDirectory(prefix="partita-calib-") as tmp:
        specs = {}
        for name, cfg in MINI.items():
            (Path(tmp) / f"{name}.json").write_text(json.dumps(cfg))
            specs[name] = str(Path(tmp) / f"{name}.json")
        only = {int(i) for i in args.only.split(",") if i}
        for idx, (model, layout, world, gb, seq) in enumerate(CASES):
            if only and idx not in only:
                continue
            spec = specs.get(model, model)
            training = TrainingConfig(global_batch=gb, seq_len=seq, dtype="f32", optimizer="adam")
            handle = resolve_model(spec)
            if (model, seq) not in graphs:
                graphs[(model, seq)] = trace_handle(handle, batch=2, seq=seq)
            graph = graphs[(model, seq)]
            uncal = parse_shorthand(f"{world}xCPU")
            # a CPU rank's share of the cores depends on how many ranks run: use the profile
            # measured with this many ranks when there is one (cpu-{N}rank-example.json)
            prof_n = profile.with_name(f"cpu-{world}rank-example.json")
            prof_n = prof_n if prof_n.exists() and args.match_nproc else profile
            link = json.loads(prof_n.read_text())["links"]["intra_node"]
            cal = calibrated_cluster(uncal, prof_n)
            if layout == "search":
                plan = Traced(handle, graph, 0.0).plan(cal, training).plan
                lay = layout_of(plan)
            else:
                lay = dict(layout)
                opts = SearchOptions(zero_stages=(0,), recompute=("none",), max_layer_units=0, max_tp=lay["tp"])
                search = Search(graph, cal, training, opts)
                plan = build_plan(search, [fixed_candidate(search, **lay)], 0.0)
            plan_dir = Path(tmp) / f"case{idx}"
            _write_outputs(plan, spec, plan_dir, cache_hit=False)
            pred = {"cal": float(plan.predicted["step_time_s"])}
            if lay is not None:
                pred["uncal"] = predict(graph, uncal, training, lay, plan.schedule)
                pred["plain"] = predict(graph, plain_cluster(world, prof_n), training, lay, plan.schedule)
            try:
                meas = measure(plan_dir, args.steps, args.repeats)
            except RuntimeError as err:  # a runtime failure is a result of this bench, not a crash
                rows.append({"case": idx, "model": model, "layout": lay, "error": str(err).splitlines()[-1]})
                print(f"{idx:>2} {model:<10} {lay} FAILED in the runtime: {rows[-1]['error']}", flush=True)
                continue
            pred["cal+calls"] = pred["cal"] + extra_call_latency(plan, meas["collectives"], link)
            row = {
                "case": idx,
                "model": model,
                "plan": "search" if layout == "search" else "fixed",
                "layout": lay or {"stages": [(s.dp, s.tp) for s in plan.stages]},
                "schedule": plan.schedule,
                "num_micro_batches": plan.num_micro_batches,
                "world": world,
                "global_batch": gb,
                "profile": prof_n.name,
                "seq_len": seq,
                "measured": meas,
                "predicted_s": pred,
                "rel_error": {k: v / meas["median_s"] - 1 for k, v in pred.items()},
            }
            rows.append(row)
            print(_line(row), flush=True)
    summary = {
        k: {
            "median_abs_rel_error": statistics.median(
                abs(r["rel_error"][k]) for r in rows if k in r.get("rel_error", {})
            ),
            "within_25pct": sum(abs(r["rel_error"][k]) <= 0.25 for r in rows if k in r.get("rel_error", {})),
            "num": sum(k in r.get("rel_error", {}) for r in rows),
        }
        for k in ("uncal", "plain", "cal", "cal+calls")
        if any(k in r.get("rel_error", {}) for r in rows)
    }
    result = {"profile": str(profile.relative_to(ROOT)) if profile.is_relative_to(ROOT) else str(profile),
              "rows": rows, "summary": summary}  # fmt: skip
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(summary, indent=1))
    return result


def _line(r: dict[str, Any]) -> str:
    lay = r["layout"]
    tag = f"dp{lay['dp']} tp{lay['tp']} pp{lay['pp']} b{lay['b']}" if "dp" in lay else str(lay)
    p, e, m = r["predicted_s"], r["rel_error"], r["measured"]
    cols = " ".join(f"{k}={p[k]:.4f}s({e[k]:+.0%})" for k in ("uncal", "plain", "cal", "cal+calls") if k in p)
    return (
        f"{r['case']:>2} {r['model']:<10} {r['plan']:<6} {tag:<20} measured={m['median_s']:.4f}s "
        f"(spread {m['spread']:.0%}) {cols}"
    )


if __name__ == "__main__":
    main(sys.argv[1:])
