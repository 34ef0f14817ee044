"""Calibration benchmark: predicted vs measured step time of real CPU runs, before and after profiling.

For small GPT-2 and Llama models (the zoo's tiny ones, and "mini" variants written as HF
``config.json`` files so the spawned training ranks resolve them too), each plan is either the
planner's own choice (``Traced.plan``) or a fixed DP / TP / PP / DPxTP layout priced with the
planner's cost path (the Candidate that ``search/evaluate.evaluate_config`` builds, turned into a
Plan by ``search/plan_build.build_plan``). Each plan is compiled to a directory and trained with
``backends/torch/launch.run``; its predicted step time is taken three ways:

* ``uncal``: the preset CPU device type (``cost_model.CPU_EFFICIENCY``, no profile);
* ``plain``: a cluster YAML whose node names the profile (``profile: PATH``), parsed by
  ``cluster.parse_cluster`` (the user's path; it must equal ``cal``);
* ``cal``: ``profile/profiler.calibrated_cluster`` (efficiency + the profile's absolute overrides).

The profiles are the held-out side: ``--reprofile BUDGET`` re-measures them first with
``partita profile`` (micro-benchmarks and the profiler's own step probes, none of them a model
here); no measured step time of this benchmark feeds them. Measured = median step time, the first
``--warmup`` steps of each launch dropped, over ``--repeats`` launches that run round-robin over
the cases (a load change on this shared 2-core machine hits every case alike); one extra
launch with collective counting (its ``TorchDispatchMode`` slows every op) only counts. Spread and
the 1-minute load average are reported: CPU timing here is noisy. Writes
``bench/results/calibration.json`` and prints a table. Usage::

    python bench/calibration.py [--reprofile 150] [--repeats 2] [--steps 8] [--only 0,2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from partita.cluster import Cluster, parse_cluster, parse_shorthand
from partita.driver import Traced, _write_outputs, trace_handle
from partita.models import resolve_model
from partita.plan import Plan
from partita.profile.profiler import calibrated_cluster
from partita.search.entry.evaluate import megatron_split
from partita.search.entry.layout_price import layout_candidate
from partita.search.entry.planner import Search
from partita.search.pricing.config import SearchOptions, TrainingConfig
from partita.search.program.plan_build import Candidate, build_plan

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
    """The Megatron-style candidate ``evaluate_config`` prices (even block split, ZeRO 0, no recompute):
    ``layout_price.layout_candidate``, the one pricing of a hand layout."""
    dev = search.cluster.device_types()[0]
    m = search.training.global_batch // (b * dp)
    split = megatron_split(search.graph, pp)
    return layout_candidate(
        search, dev, tps=(tp,) * pp, ranges=split, dp=dp, micro_batch=b, num_micro_batches=m, schedule=schedule
    )


def layout_of(plan: Plan) -> dict[str, int] | None:
    """The (dp, tp, pp, b) of a plan whose stages are uniform, else None."""
    s0 = plan.stages[0]
    if any((s.dp, s.tp) != (s0.dp, s0.tp) for s in plan.stages) or plan.num_virtual_stages != 1:
        return None
    return {"dp": s0.dp, "tp": s0.tp, "pp": plan.num_stages, "b": plan.micro_batch_size}


def predict(graph: Any, cluster: Cluster, training: TrainingConfig, lay: dict[str, int], schedule: str) -> float:
    opts = SearchOptions(zero_stages=(0,), recompute=("none",), max_layer_units=0, max_tp=lay["tp"])
    return fixed_candidate(Search(graph, cluster, training, opts), **lay, schedule=schedule).step_time


def plain_cluster(world: int, profile: Path, tmp: Path) -> Cluster:
    """The user's path: a cluster file whose node names the profile (``profile:``), parsed."""
    path = tmp / f"cluster-{world}-{profile.stem}.yaml"
    path.write_text(f"name: cpu{world}\nnodes: [{{device: CPU, gpus_per_node: {world}, profile: {profile}}}]\n")
    return parse_cluster(str(path))


def idle_fraction(window_s: float = 1.0) -> float:
    """Share of all cores idle over ``window_s`` (``/proc/stat``): how busy the other tenants keep the machine."""

    def sample() -> tuple[int, int]:
        vals = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
        return vals[3] + vals[4], sum(vals)  # idle + iowait, total

    (i0, t0), _ = sample(), time.sleep(window_s)
    i1, t1 = sample()
    return (i1 - i0) / max(t1 - t0, 1)


def wait_quiet(min_idle: float, max_wait_s: float) -> float:
    """Wait (up to ``max_wait_s``) until at least ``min_idle`` of the cores are idle; the idle share seen."""
    end = time.perf_counter() + max_wait_s
    idle = idle_fraction()
    while idle < min_idle and time.perf_counter() < end:
        time.sleep(3.0)
        idle = idle_fraction()
    return idle


QUIET = {"min_idle": 0.0, "max_wait_s": 0.0}  # set from --min-idle / --max-wait


def launch(plan_dir: Path, steps: int, count: bool) -> dict[str, Any]:
    """One ``partita run`` of the plan: per-step times (max over ranks) and, when counting, collectives."""
    from partita.backends.torch.launch import run

    idle = wait_quiet(**QUIET) if QUIET["min_idle"] > 0 else None
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    res = run(plan_dir, steps=steps, extra_args=() if count else ("--no-count",))
    return {"steps_s": res["step_time_s"], "wall_s": time.perf_counter() - t0, "load": load, "idle_before": idle,
            "collectives": {"measured": res.get("collectives", {}), "predicted": res.get("predicted_collectives", {})}}  # fmt: skip


def summarize(timed: list[dict[str, Any]], counted: dict[str, Any] | None, warmup: int) -> dict[str, Any]:
    """Median step time (first ``warmup`` steps of each launch dropped) per launch, then over launches."""
    medians = [statistics.median(t["steps_s"][warmup:]) for t in timed]
    steps = sorted(x for t in timed for x in t["steps_s"][warmup:])
    return {
        "median_s": statistics.median(medians),
        "per_launch_s": medians,
        "spread": (max(medians) - min(medians)) / statistics.median(medians),
        "step_p25_p75_s": [steps[len(steps) // 4], steps[(3 * len(steps)) // 4]],
        "launch_wall_s": [t["wall_s"] for t in timed],
        "load_avg_1min": [t["load"] for t in timed],
        "idle_before": [t["idle_before"] for t in timed],
        "collectives": counted["collectives"] if counted else {},
    }


def extra_call_latency(plan: Plan, counts: dict[str, Any], link: dict[str, float]) -> float:
    """Diagnostic: latency of the collective calls the runtime issues beyond those the plan prices
    (e.g. one all-reduce per gradient tensor against one bucketed all-reduce), from the profile's
    alpha and fixed latency; the max over stages (they run concurrently)."""
    from partita.profile.profiler import collective_factors

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


def reprofile(worlds: set[int], budget_s: float) -> dict[str, Any]:
    """Fresh ``partita profile`` runs (one per rank count) into ``partita/data/profiles``."""
    from partita.profile.profiler import profile

    out = {}
    for n in sorted(worlds):
        idle = wait_quiet(**QUIET) if QUIET["min_idle"] > 0 else None
        t0 = time.perf_counter()
        load = os.getloadavg()[0]
        prof = profile("cpu", nproc=n, out=str(PROFILE.with_name(f"cpu-{n}rank-example.json")),
                       time_budget_s=budget_s, progress=False)  # fmt: skip
        out[f"cpu-{n}rank"] = {"wall_s": time.perf_counter() - t0, "load_avg_1min": load, "idle_before": idle,
                               "efficiency": prof["efficiency"], "step_fit": prof["fit"].get("step")}  # fmt: skip
        print(f"profiled {n} ranks in {out[f'cpu-{n}rank']['wall_s']:.0f} s (load {load:.1f})", flush=True)
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", default=str(PROFILE))
    ap.add_argument("--repeats", type=int, default=2, help="timed launches per case (plus one counting launch)")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2, help="steps dropped at the start of each launch")
    ap.add_argument("--only", default="", help="comma-separated case indices")
    ap.add_argument("--out", default=str(OUT))
    ap.add_argument("--reprofile", type=float, default=0.0, help="re-measure the profiles first (budget, s)")
    ap.add_argument("--min-idle", type=float, default=0.0, help="wait for this idle share of the cores first")
    ap.add_argument("--max-wait", type=float, default=120.0, help="longest such wait per launch (s)")
    ap.add_argument("--no-count", dest="count", action="store_false", help="skip the collective-counting launch")
    ap.add_argument("--no-match-nproc", dest="match_nproc", action="store_false", help="one profile for all")
    args = ap.parse_args(argv)
    QUIET.update(min_idle=args.min_idle, max_wait_s=args.max_wait)
    profile = Path(args.profile).resolve()
    only = {int(i) for i in args.only.split(",") if i}
    cases = [(i, c) for i, c in enumerate(CASES) if not only or i in only]
    profiling = reprofile({1, 2} | {c[2] for _, c in cases}, args.reprofile) if args.reprofile else {}
    rows: list[dict[str, Any]] = []
    graphs: dict[tuple[str, int], Any] = {}
    with tempfile.TemporaryDirectory(prefix="partita-calib-") as tmp_s:
        tmp = Path(tmp_s)
        specs = {}
        for name, cfg in MINI.items():
            (tmp / f"{name}.json").write_text(json.dumps(cfg))
            specs[name] = str(tmp / f"{name}.json")
        compiled = []  # every plan first, then the launches round-robin (load drift hits all cases alike)
        for idx, (model, layout, world, gb, seq) in cases:
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
            cal = calibrated_cluster(uncal, prof_n)
            if layout == "search":
                plan = Traced(handle, graph, 0.0).plan(cal, training).plan
                lay = layout_of(plan)
            else:
                lay = dict(layout)
                opts = SearchOptions(zero_stages=(0,), recompute=("none",), max_layer_units=0, max_tp=lay["tp"])
                search = Search(graph, cal, training, opts)
                plan = build_plan(search, [fixed_candidate(search, **lay)], 0.0)
            plan_dir = tmp / f"case{idx}"
            _write_outputs(plan, spec, plan_dir, cache_hit=False)
            pred = {"cal": float(plan.predicted["step_time_s"])}
            run_world = plan.world_size  # a searched plan may leave devices idle: ranks launched set the contention
            prof_run = profile.with_name(f"cpu-{run_world}rank-example.json")
            prof_run = prof_run if prof_run.exists() and args.match_nproc else prof_n
            if lay is not None:
                run_cl = parse_shorthand(f"{run_world}xCPU")
                pred["uncal"] = predict(graph, run_cl, training, lay, plan.schedule)
                pred["plain"] = predict(graph, plain_cluster(run_world, prof_run, tmp), training, lay, plan.schedule)
                if run_world != world:
                    pred["cal"] = predict(graph, calibrated_cluster(run_cl, prof_run), training, lay, plan.schedule)
            prof_n = prof_run
            row = {"case": idx, "model": model, "plan": "search" if layout == "search" else "fixed",
                   "layout": lay or {"stages": [(s.dp, s.tp) for s in plan.stages]}, "schedule": plan.schedule,
                   "num_micro_batches": plan.num_micro_batches, "world": world, "global_batch": gb,
                   "profile": prof_n.name, "seq_len": seq, "predicted_s": pred,
                   "predicted_breakdown": {k: plan.predicted[k] for k in ("compute_s", "communication_s",
                                                                          "bubble_s", "tail_s")}}  # fmt: skip
            compiled.append((row, plan, plan_dir, json.loads(prof_n.read_text())["links"].get("intra_node")))
        launches: dict[int, dict[str, Any]] = {r["case"]: {"timed": [], "counted": None} for r, *_ in compiled}
        rounds = (["count"] if args.count else []) + ["time"] * args.repeats
        for rnd in rounds:
            for row, _plan, plan_dir, _link in compiled:
                got = launches[row["case"]]
                if "error" in got:
                    continue
                try:
                    res = launch(plan_dir, args.steps if rnd == "time" else 2, rnd == "count")
                except RuntimeError as err:  # a runtime failure is a result of this bench, not a crash
                    got["error"] = str(err).splitlines()[-1]
                    print(f"{row['case']:>2} {row['model']:<10} FAILED in the runtime: {got['error']}", flush=True)
                    continue
                got["timed" if rnd == "time" else "counted"] = [*got["timed"], res] if rnd == "time" else res
        for row, plan, _plan_dir, link in compiled:
            got = launches[row["case"]]
            if "error" in got or not got["timed"]:
                rows.append({k: row[k] for k in ("case", "model", "layout")} | {"error": got.get("error", "no run")})
                continue
            meas = summarize(got["timed"], got["counted"], args.warmup)
            pred = row["predicted_s"]
            if meas["collectives"] and link:
                pred["cal+calls"] = pred["cal"] + extra_call_latency(plan, meas["collectives"], link)
            row |= {"measured": meas, "rel_error": {k: v / meas["median_s"] - 1 for k, v in pred.items()}}
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
              "profiling": profiling, "rows": rows, "summary": summary}  # fmt: skip
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
