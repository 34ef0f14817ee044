"""Expert parallelism in the search: mixtral-8x7b (zoo, HF MixtralForCausalLM) on 64xH100-80G.

Ablation of ``passes/moe.py`` (which makes the traced experts shardable: the ``expert`` tp role,
``search/strategies.expert_tp_strategies``, run by ``backends/torch/moe.py``). The same search
runs on graphs that differ only by that pass, under the same cost model:

* the default search (ZeRO 0-3): data parallelism with ZeRO-3 wins and tp stays 1, so expert
  parallelism (which lives on the tp axis) cannot matter;
* the search held to ZeRO-0/1 (parameters not sharded over dp): the model needs tp or pipeline
  stages to fit, and with the pass the tp stages run the experts expert-parallel instead of
  replicated on every tp rank.

Reports predicted step time, the layout, how many MoE layers run ``expert`` and the all_to_all per
step the plan records. Writes ``bench/results/moe_expert_parallel.json`` and prints the table.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from partita.cluster import parse_cluster
from partita.frontends.trace import trace_handle
from partita.models import resolve_model
from partita.passes.pipeline import PassOptions
from partita.search.entry.planner import plan_graph
from partita.search.pricing.config import SearchOptions, TrainingConfig

OUT = Path(__file__).parent / "results" / "moe_expert_parallel.json"
MODEL, CLUSTER, BATCH, SEQ = "mixtral-8x7b", "64xH100-80G", 256, 4096
SEARCHES = {"default (ZeRO 0-3)": (0, 1, 2, 3), "ZeRO 0/1 only": (0, 1)}
VARIANTS = {"with passes/moe.py": (), "without": ("mark_experts",)}


def main() -> None:
    handle = resolve_model(MODEL)
    cl = parse_cluster(CLUSTER)
    tr = TrainingConfig(global_batch=BATCH, seq_len=SEQ)
    graphs = {v: trace_handle(handle, seq=SEQ, passes=PassOptions(skip=skip)) for v, skip in VARIANTS.items()}
    rows = []
    for search, zero in SEARCHES.items():
        for variant, g in graphs.items():
            c0 = time.process_time()
            plan = plan_graph(g, cl, tr, options=SearchOptions(zero_stages=zero))
            roles = [r for s in plan.stages for r in s.tp_plan.values()]
            rows.append(
                {
                    "search": search,
                    "graph": variant,
                    "step_time_s": round(float(plan.predicted["step_time_s"]), 4),
                    "layout": " | ".join(f"{s.dp}x{s.tp} z{s.zero_stage} {len(s.layers)}L" for s in plan.stages),
                    "expert_layers": roles.count("expert"),
                    "all_to_all_per_step": sum(
                        c.count for s in plan.stages for c in s.collectives if c.kind == "all_to_all"
                    ),
                    "search_cpu_s": round(time.process_time() - c0, 1),
                }
            )
    for search in SEARCHES:
        a, b = (next(r for r in rows if r["search"] == search and r["graph"] == v) for v in VARIANTS)
        a["speedup_vs_without"] = round(b["step_time_s"] / a["step_time_s"], 3)
    OUT.write_text(
        json.dumps({"model": MODEL, "cluster": CLUSTER, "global_batch": BATCH, "seq": SEQ, "rows": rows}, indent=1)
        + "\n"
    )
    print(f"{MODEL} on {CLUSTER}, batch {BATCH} x {SEQ} (predicted; this machine's CPU seconds for the search)")
    print(f"{'search':20} {'graph':20} {'step s':>8} {'EP layers':>9} {'a2a/step':>8}  layout")
    for r in rows:
        print(
            f"{r['search']:20} {r['graph']:20} {r['step_time_s']:8.3f} {r['expert_layers']:9d} "
            f"{r['all_to_all_per_step']:8d}  {r['layout']}  {r.get('speedup_vs_without', '')}"
        )


if __name__ == "__main__":
    main()
