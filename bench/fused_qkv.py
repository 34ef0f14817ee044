"""Ablation of ``passes/fused_split.py`` on GPT-2-architecture models (the zoo's gpt3 entries).

HF GPT-2 computes q|k|v with one ``Conv1D`` of width 3h and splits its output in three. Without
the pass, a tp split of that width hands rank r a contiguous third of [q|k|v], not heads of each:
the ILP either all-gathers before attention or keeps attention replicated. With it, the width is
factored (3, h) and the ILP can split each chunk per head (Megatron's layout, ``SS(d,3)``).

For each case the search runs twice, on graphs that differ only by that pass, under the same cost
model: predicted step time, tp degrees chosen and the c_attn placement. A fixed tp=8 configuration
is also priced both ways (``evaluate_config``, the ILP free on the tp axis).
Writes ``bench/results/fused_qkv.json`` and prints the table.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from gpt_graphs import gpt_graph  # noqa: E402

from partita.cluster import parse_cluster  # noqa: E402
from partita.search.entry.evaluate import evaluate_config  # noqa: E402
from partita.search.entry.planner import plan_graph  # noqa: E402
from partita.search.pricing.config import SearchOptions, TrainingConfig  # noqa: E402

OUT = Path(__file__).parent / "results" / "fused_qkv.json"
MODELS = {"gpt3-1.3b": (2048, 16, 24), "gpt3-6.7b": (4096, 32, 32), "gpt3-13b": (5120, 40, 40)}
# (cluster, model, global batch): at batch 256 plain data parallelism (ZeRO) wins and tp stays 1,
# so the pass cannot matter; the small batches / 40 GB cards make the search use tp.
CASES = [
    ("8xA100-80G", "gpt3-1.3b", 256),
    ("16xA100-80G+16xV100-32G", "gpt3-6.7b", 256),
    ("8xA100-40G", "gpt3-6.7b", 16),
    ("16xA100-80G", "gpt3-13b", 32),
    ("8xA100-40G+8xV100-32G", "gpt3-13b", 16),
]
VARIANTS = {"without pass": ("split_fused_projections",), "with pass": ()}


def _c_attn(plan: object) -> str:
    """The tp placement of the first block's c_attn weight in the first stage with tp > 1."""
    for s in plan.stages:  # type: ignore[attr-defined]
        if s.tp > 1:
            for name, pl in sorted(s.param_placements.items()):
                if name.endswith("attn.c_attn.weight"):
                    return ",".join(pl)
    return "-"


def _stages(plan: object) -> list[str]:
    return [f"{s.device_type} dp{s.dp} tp{s.tp} {len(s.layers)}L" for s in plan.stages]  # type: ignore[attr-defined]


def main() -> dict:
    res: dict = {"search": [], "fixed": []}
    opts = SearchOptions(max_micro_batch=8, schedules=("1f1b",))
    print("search (partita compile's planner), predicted step time:")
    print(
        f"{'cluster':<26} {'model':<10} {'batch':>5} {'without pass':>13} {'with pass':>10} {'speedup':>8}  tp / c_attn"
    )
    for cname, mname, batch in CASES:
        cl = parse_cluster(cname)
        tr = TrainingConfig(global_batch=batch, seq_len=2048)
        row: dict = {"cluster": cname, "model": mname, "global_batch": batch}
        for variant, skip in VARIANTS.items():
            g = gpt_graph(*MODELS[mname], 2048, skip_passes=skip)
            t0 = time.perf_counter()
            plan = plan_graph(g, cl, tr, options=opts)
            row[variant] = {
                "step_time_s": plan.predicted["step_time_s"],
                "search_s": time.perf_counter() - t0,
                "stages": _stages(plan),
                "c_attn": _c_attn(plan),
            }
        off, on = row["without pass"], row["with pass"]
        row["speedup"] = off["step_time_s"] / on["step_time_s"]
        res["search"].append(row)
        tps = ",".join(s.split()[2] for s in on["stages"])
        print(
            f"{cname:<26} {mname:<10} {batch:>5} {off['step_time_s']:12.3f}s {on['step_time_s']:9.3f}s "
            f"{row['speedup']:7.3f}x  {tps} / {on['c_attn']} (without: {off['c_attn']})",
            flush=True,
        )
    print("fixed Megatron-shaped configuration (8xA100-80G, dp1 tp8 pp1, micro-batch 1, batch 8), ILP free on tp:")
    cl = parse_cluster("8xA100-80G")
    tr = TrainingConfig(global_batch=8, seq_len=2048)
    for mname in ("gpt3-6.7b", "gpt3-13b"):
        row = {"model": mname}
        for variant, skip in VARIANTS.items():
            g = gpt_graph(*MODELS[mname], 2048, skip_passes=skip)
            ev = evaluate_config(g, cl, tr, tp=8, pp=1, dp=1, micro_batch=1, tp_style="auto")
            row[variant] = {"step_time_s": ev.predicted_step_time_s, "fits": ev.fits}
        row["speedup"] = row["without pass"]["step_time_s"] / row["with pass"]["step_time_s"]
        res["fixed"].append(row)
        print(
            f"  {mname:<10} without {row['without pass']['step_time_s']:.3f}s  "
            f"with {row['with pass']['step_time_s']:.3f}s  {row['speedup']:.3f}x",
            flush=True,
        )
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(res, indent=1, sort_keys=True) + "\n")
    return res


if __name__ == "__main__":
    main()
