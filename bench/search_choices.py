"""The search's choice of context parallelism and FP8 (issue 36): each case searched with and without the
choice in the same run, the ratio of their predicted steps, and the plan's own record of why.

* cp: Llama-2 7B's shape with 65,536 positions (``examples/configs/llama-2-7b-64k.json``) on 64 H100-80G,
  global batch 16 at 65,536 tokens (bench/context_parallel.py's case, there priced as hand layouts), the
  search with cp degrees 2, 4, 8 (what ``search/program/realizable.cp_degrees`` offers there once the
  torch program builds cp) against the search without cp; and the same model at 4,096 tokens, batch 64,
  cp 2 and 4 asked for, where cp 1 is kept.
* fp8: the zoo's llama-7b (stored trace) at 4,096 tokens, batch 64, on 8 H100-80G and on 8 A100-80G +
  8 H100-80G, and llama-70b on 64 H100-80G: the search with fp8 allowed (``--precision fp8`` without a
  layout) against the bf16 search; each stage keeps its device type's precision (``Stage.fp8``: the
  A100s' stages bf16 beside fp8 H100 stages), the row's ``precision_by_type`` says which.

Every search runs with the default ``SearchOptions`` but the choice. Writes
``bench/results/search_choices.json`` and prints a table (step without / with the choice, speed-up,
what was chosen, and the record's sentence).
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

from partita.cluster import parse_cluster
from partita.driver import trace_model
from partita.search.entry.planner import plan_graph
from partita.search.layer.memo import IntraOpMemo
from partita.search.pricing.config import SearchOptions, TrainingConfig

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "results" / "search_choices.json"
LLAMA_64K = str(ROOT / "examples/configs/llama-2-7b-64k.json")
CASES = [  # (name, model, trace seq, cluster, training, choice: cp degrees or an fp8 recipe)
    (
        "cp llama-2-7b @65536",
        LLAMA_64K,
        65536,
        "64xH100-80G",
        TrainingConfig(global_batch=16, seq_len=65536),
        (2, 4, 8),
    ),
    ("cp llama-2-7b @4096", LLAMA_64K, 65536, "64xH100-80G", TrainingConfig(global_batch=64, seq_len=4096), (2, 4)),
    (
        "fp8 llama-7b 8xH100",
        "llama-7b",
        2048,
        "8xH100-80G",
        TrainingConfig(global_batch=64, seq_len=4096),
        "tensorwise",
    ),
    (
        "fp8 llama-7b A100+H100",
        "llama-7b",
        2048,
        "8xA100-80G+8xH100-80G",
        TrainingConfig(global_batch=64, seq_len=4096),
        "tensorwise",
    ),
    (
        "fp8 llama-70b 64xH100",
        "llama-70b",
        2048,
        "64xH100-80G",
        TrainingConfig(global_batch=64, seq_len=4096),
        "tensorwise",
    ),
]


def _layout(plan) -> str:  # noqa: ANN001
    s = plan.stages
    return f"{len(s)} stage(s), " + ", ".join(
        sorted(
            {
                f"dp{x.dp} cp{x.cp} tp{x.tp} z{x.zero_stage} {x.recompute}" + (f" {x.device_type} fp8" if x.fp8 else "")
                for x in s
            }
        )
    )


def main() -> dict:
    rows = []
    graphs: dict[tuple[str, int], object] = {}
    for name, model, seq, cluster, tr, choice in CASES:
        if (model, seq) not in graphs:
            graphs[(model, seq)] = trace_model(model, seq=seq).graph
        g, cl, memo = graphs[(model, seq)], parse_cluster(cluster), IntraOpMemo()
        t0 = time.perf_counter()
        base = plan_graph(g, cl, tr, options=SearchOptions(cp_degrees=()), memo=memo)  # type: ignore[arg-type]
        t_base = time.perf_counter() - t0
        if isinstance(choice, tuple):
            opts, tr2, key = SearchOptions(cp_degrees=choice), tr, "context_parallel"
        else:
            opts, tr2, key = SearchOptions(cp_degrees=()), dataclasses.replace(tr, fp8=choice), "fp8"
        t0 = time.perf_counter()
        got = plan_graph(g, cl, tr2, options=opts, memo=memo)  # type: ignore[arg-type]
        rec = got.search[key]
        rows.append(
            {
                "case": name,
                "cluster": cluster,
                "global_batch": tr.global_batch,
                "seq_len": tr.seq_len,
                "choice": list(choice) if isinstance(choice, tuple) else choice,
                "without_s": base.predicted["step_time_s"],
                "with_s": got.predicted["step_time_s"],
                "speedup": base.predicted["step_time_s"] / got.predicted["step_time_s"],
                "chosen": rec.get("chosen"),
                "layout_without": _layout(base),
                "layout_with": _layout(got),
                "why": rec.get("why"),
                **({"precision_by_type": rec["types"]} if "types" in rec else {}),  # fp8: each type's (Stage.fp8)
                "search_s_without": t_base,
                "search_s_with": time.perf_counter() - t0,
            }
        )
        print(f"{name}: {time.perf_counter() - t0:.0f} s")
    OUT.write_text(json.dumps({"rows": rows}, indent=1) + "\n")
    print(f"{'case':24} {'without s':>10} {'with s':>10} {'speedup':>7} {'chosen':>7}  layout with the choice / why")
    for r in rows:
        print(
            f"{r['case']:24} {r['without_s']:10.4f} {r['with_s']:10.4f} {r['speedup']:7.3f} {str(r['chosen']):>7}  "
            f"{r['layout_with']}\n{'':63}{r['why']}"
        )
    return {"rows": rows}


if __name__ == "__main__":
    main()
