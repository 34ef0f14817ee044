"""Mixed clusters: does the plan use the older GPUs, how much faster is it, and how far from a homogeneous cluster.

For GPT-3 13B and 39B on ``mixed-lab`` (16 A100-80G + 16 V100-32G + 8 L4) and 16 A100-80G + 16
V100-32G, global batch 256 x 2048, all priced by the planner's own cost path:

* ``partita``: ``plan_graph`` with the defaults (a bf16 request trains in fp16 when the cluster has
  GPUs without bf16 tensor cores, ``search/pricing/precision.py``); ``bf16``: the same search held to bf16;
* ``best subset``: the best plan on any single device type of the cluster (same search, same dtype
  rule); speedup = its step time / ours;
* heterogeneity gap = 1 - MFU(mixed plan, vs the whole cluster's peak) / MFU(plan on a homogeneous
  A100-80G cluster of about the same total peak FLOP/s: the multiple of 8 nearest to it). Published
  heterogeneous systems report gaps from 0.3% to 12%.

Writes ``bench/results/hetero.json`` and prints a table. ``--quick``: 13B only.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from gpt_graphs import gpt_graph  # noqa: E402

from partita.cluster import DEVICE_PRESETS, Cluster, parse_cluster  # noqa: E402
from partita.errors import InfeasibleError  # noqa: E402
from partita.search.entry.baselines import subset  # noqa: E402
from partita.search.entry.planner import plan_graph  # noqa: E402
from partita.search.pricing.config import SearchOptions, TrainingConfig  # noqa: E402

OUT = Path(__file__).parent / "results" / "hetero.json"
CLUSTERS = ["mixed-lab", "16xA100-80G+16xV100-32G"]
MODELS = {"gpt3-13b": (5120, 40, 40), "gpt3-39b": (8192, 64, 48)}
TR = TrainingConfig(global_batch=256, seq_len=2048)
OPTS = SearchOptions(max_micro_batch=8)


def used_by_type(plan: Any) -> dict[str, int]:
    out: dict[str, int] = {}
    ranks = parse_ranks(plan)
    for r in plan.cluster["rank_map"]:
        out[ranks[r]] = out.get(ranks[r], 0) + 1
    return out


def parse_ranks(plan: Any) -> list[str]:
    names = []
    for g in plan.cluster["spec"]["groups"]:
        names += [g["device"]["name"]] * (g["num_nodes"] * g["gpus_per_node"])
    return names


def try_plan(graph: Any, cl: Cluster, opts: SearchOptions) -> Any:
    try:
        return plan_graph(graph, cl, TR, options=opts)
    except InfeasibleError:
        return None


def homogeneous_twin(cl: Cluster, dtype: str) -> tuple[Cluster, float]:
    """A100-80G x (multiple of 8 nearest the cluster's peak), and its peak / the cluster's."""
    a100 = DEVICE_PRESETS["A100-80G"].flops(dtype)
    n = max(8, 8 * round(cl.peak_flops(dtype) / a100 / 8))
    twin = parse_cluster(f"{n}xA100-80G")
    return twin, twin.peak_flops(dtype) / cl.peak_flops(dtype)


def case(cname: str, mname: str, dims: tuple[int, int, int]) -> dict[str, Any]:
    g = gpt_graph(dims[0], dims[1], dims[2], 2048)
    cl = parse_cluster(cname)
    t0 = time.perf_counter()
    ours = plan_graph(g, cl, TR, options=OPTS)
    search_s = time.perf_counter() - t0
    bf16 = try_plan(g, cl, dataclasses.replace(OPTS, allow_f16=False))
    subsets = {}
    for d in cl.device_types():
        p = try_plan(g, subset(cl, d.name), OPTS)
        subsets[d.name] = p.predicted["step_time_s"] if p else None
    best_name = min((k for k, v in subsets.items() if v), key=lambda k: subsets[k])  # type: ignore[arg-type, return-value]
    dtype = ours.training["dtype"]
    twin, ratio = homogeneous_twin(cl, dtype)
    homog = plan_graph(g, twin, dataclasses.replace(TR, dtype=dtype), options=OPTS)
    mfu_mixed, mfu_homog = ours.predicted["mfu_cluster"], homog.predicted["mfu_cluster"]
    return {
        "cluster": cname,
        "model": mname,
        "dtype": dtype,
        "partita_s": ours.predicted["step_time_s"],
        "used": used_by_type(ours),
        "bf16_s": bf16.predicted["step_time_s"] if bf16 else None,
        "bf16_used": used_by_type(bf16) if bf16 else None,
        "subset_s": subsets,
        "best_subset": best_name,
        "speedup_vs_best_subset": subsets[best_name] / ours.predicted["step_time_s"],  # type: ignore[operator]
        "mfu_cluster": mfu_mixed,
        "homogeneous": {"cluster": twin.name, "peak_ratio": ratio, "mfu_cluster": mfu_homog},
        "heterogeneity_gap": 1 - mfu_mixed / mfu_homog,
        "idle_reasons": ours.predicted.get("idle_reasons", {}),
        "stages": [f"{s.device_type} {s.dp}x{s.tp} shares={list(s.batch_shares)}" for s in ours.stages],
        "search_s": search_s,
    }


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="13B only")
    args = ap.parse_args(argv)
    rows = []
    models = {k: v for k, v in MODELS.items() if not args.quick or k == "gpt3-13b"}
    for cname in CLUSTERS:
        for mname, dims in models.items():
            r = case(cname, mname, dims)
            rows.append(r)
            used = " ".join(f"{n}x{k}" for k, n in r["used"].items())
            bf = f"{r['bf16_s']:.3f}s" if r["bf16_s"] else "infeasible"
            print(
                f"{cname:<26} {mname:<9} {r['dtype']} {r['partita_s']:7.3f}s on {used:<28} bf16 {bf:<9} "
                f"best subset {r['best_subset']} x{r['speedup_vs_best_subset']:.2f}  MFU {r['mfu_cluster']:.1%} vs "
                f"{r['homogeneous']['cluster']} {r['homogeneous']['mfu_cluster']:.1%} (gap {r['heterogeneity_gap']:+.1%}, "
                f"peak ratio {r['homogeneous']['peak_ratio']:.2f})  search {r['search_s']:.0f}s",
                flush=True,
            )
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(rows, indent=1, sort_keys=True) + "\n")
    return rows


if __name__ == "__main__":
    main()
