"""Mixed-cluster benchmark: Partita's plan vs a heterogeneity-unaware plan vs Megatron on the largest
homogeneous subset, all priced by the same cost path. Writes bench/results/hetero.json and a table."""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from gpt_graphs import gpt_graph  # noqa: E402

from partita.cluster import parse_cluster  # noqa: E402
from partita.search.baselines import heterogeneity_unaware, largest_homogeneous_subset  # noqa: E402
from partita.search.config import SearchOptions, TrainingConfig  # noqa: E402
from partita.search.planner import plan_graph  # noqa: E402

OUT = Path(__file__).parent / "results" / "hetero.json"
CLUSTERS = ["8xA100-80G+8xV100-32G", "16xA100-40G+16xL4", "16xA100-80G+16xV100-32G+8xL4"]
MODELS = {"gpt3-1.3b": (2048, 16, 24), "gpt3-2.7b": (2560, 32, 32), "gpt3-6.7b": (4096, 32, 32)}


def main() -> None:
    rows = []
    tr = TrainingConfig(global_batch=256, seq_len=2048)
    opts = SearchOptions(max_micro_batch=8, schedules=("1f1b",))
    for cname in CLUSTERS:
        cl = parse_cluster(cname)
        for mname, dims in MODELS.items():
            g = gpt_graph(*dims, 2048)
            t0 = time.perf_counter()
            plan = plan_graph(g, cl, tr, options=opts)
            ours = plan.predicted["step_time_s"]
            search_s = time.perf_counter() - t0
            _, unaware = heterogeneity_unaware(g, cl, tr, opts)
            name, grid = largest_homogeneous_subset(g, cl, tr, max_micro_batch=8)
            meg = grid.evaluation.predicted_step_time_s if grid else math.inf
            rows.append(
                {
                    "cluster": cname,
                    "model": mname,
                    "partita_s": ours,
                    "unaware_s": unaware,
                    "megatron_subset_s": meg,
                    "subset": name,
                    "search_s": search_s,
                    "stages": [f"{s.device_type} {s.dp}x{s.tp} shares={list(s.batch_shares)}" for s in plan.stages],
                }
            )
            print(
                f"{cname:<30} {mname:<10} partita {ours:8.3f}s  unaware {unaware:8.3f}s ({unaware / ours:4.2f}x)  "
                f"megatron[{name}] {meg:8.3f}s ({meg / ours:4.2f}x)  search {search_s:5.1f}s",
                flush=True,
            )
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(rows, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
