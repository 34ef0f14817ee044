"""Pipeline schedules compared under the cost model: the best plan per schedule family (issue 19).

For GPT-3 13B (seq 2048) on 32 A100-80G and on 16 A100-80G + 16 V100-32G, at global batches 32 and
256, the planner runs once per family with ``SearchOptions(schedules=(family,))`` (max micro-batch
8) and the winner's predicted step time, bubble, peak memory per device and layout are recorded.
Every step is the family's action list simulated (``search/pipeline/pipeline_sim.py``) on the stages' F, B, W
times, plus the exposed gradient-sync / optimizer tail. Zero-bubble families (``zb_h1``, ``zbv``)
search only ZeRO-0 stages without recompute (what the torch runtime runs with a split backward); the
row ``1f1b same space`` holds 1F1B to that space too, so the schedule's own effect reads apart from
the ZeRO / recompute options it gives up. ``runs`` says whether ``emit_torch`` accepts the plan.
``zbv`` is priced on the V layout the runtime runs (``search/program/v_layout.py``: from the best ZB-H1
candidates of the best configurations, the model cut into ``2p`` chunks, chunk ``s`` on rank group
``s`` or ``2p - 1 - s``, each chunk priced on its own layers); ``zbv same space`` holds it to ZeRO-0
without recompute like ``1f1b same space``; ``default - zbv`` is the default search without ZB-V (the
default searched every family but ZB-V until its rehearsal matched its plan). ``interleaved_1f1b``
only refines the best 1F1B plans that have several stages, and keeps the candidates the torch
program runs as model chunks (ZeRO-0/1 over dp > 1, layer kinds kept: ``search/program/chunk_layout.py``);
where none qualifies it returns a 1F1B plan (column ``got``); ``interleaved same space`` searches it
in the ZeRO-0 / no-recompute space, where it can. A chunked plan's layout lists its rank groups, each
with its chunks' layer counts. The row ``default search`` is ``partita compile``'s search (its
schedules: ``SearchOptions().schedules``).

Writes ``bench/results/schedules.json`` and prints the table; ``vs best`` is the step time over the
best family's in the same case (predictions, not measurements).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from gpt_graphs import gpt_graph  # noqa: E402

from partita.cluster import parse_cluster  # noqa: E402
from partita.errors import PartitaError  # noqa: E402
from partita.search.entry.planner import plan_graph  # noqa: E402
from partita.search.pricing.config import SearchOptions, TrainingConfig  # noqa: E402

OUT = Path(__file__).parent / "results" / "schedules.json"
MODEL = ("gpt3-13b", (5120, 40, 40))
CLUSTERS = ["32xA100-80G", "16xA100-80G+16xV100-32G"]
BATCHES = [32, 256]
ROWS: dict[str, dict[str, Any]] = {
    "default search": {},  # SearchOptions().schedules: what partita compile searches
    "1f1b": {"schedules": ("1f1b",)},
    "1f1b same space": {"schedules": ("1f1b",), "zero_stages": (0,), "recompute": ("none",)},
    "gpipe": {"schedules": ("gpipe",)},
    "interleaved_1f1b": {"schedules": ("interleaved_1f1b",)},
    "interleaved same space": {"schedules": ("interleaved_1f1b",), "zero_stages": (0,), "recompute": ("none",)},
    "zb_h1": {"schedules": ("zb_h1",)},
    "zbv": {"schedules": ("zbv",)},
    "zbv same space": {"schedules": ("zbv",), "zero_stages": (0,), "recompute": ("none",)},
    "default - zbv": {"schedules": tuple(s for s in SearchOptions().schedules if s != "zbv")},
}


def _runs(plan: Any) -> bool:
    from partita.backends.torch.emit import check_schedule

    try:
        check_schedule(plan)
    except PartitaError:
        return False
    return True


def _layout(plan: Any) -> str:
    v = f" v{plan.num_virtual_stages}" if plan.num_virtual_stages > 1 else ""
    stages = " ".join(
        f"[{'+'.join(str(len(s.layers)) for s in g)}L dp{g[0].dp} tp{g[0].tp} z{g[0].zero_stage} {g[0].recompute}]"
        for g in plan.positions()  # a chunked plan: its chunks' layer counts per rank group
    )
    return f"m={plan.num_micro_batches}x{plan.micro_batch_size}{v} {stages}"


def main() -> dict:
    graph = gpt_graph(*MODEL[1], 2048)
    cases = []
    print(f"{MODEL[0]}, seq 2048: best plan per pipeline schedule family (predicted by the cost model)")
    print(f"default search schedules: {SearchOptions().schedules}")
    head = f"{'family':<23} {'got':<16} {'runs':<5} {'step':>8} {'vs best':>8} {'bubble':>8} {'peak mem':>9}  layout"
    for cname in CLUSTERS:
        cl = parse_cluster(cname)
        for batch in BATCHES:
            tr = TrainingConfig(global_batch=batch, seq_len=2048)
            rows = []
            for name, kw in ROWS.items():
                t0 = time.process_time()
                plan = plan_graph(graph, cl, tr, options=SearchOptions(max_micro_batch=8, **kw))
                rows.append(
                    {
                        "family": name,
                        "schedule": plan.schedule,
                        "num_virtual_stages": plan.num_virtual_stages,
                        "num_stages": plan.num_positions,
                        "runs_on_torch": _runs(plan),
                        "step_time_s": plan.predicted["step_time_s"],
                        "bubble_s": plan.predicted["bubble_s"],
                        "peak_memory_bytes": max(plan.predicted["memory_per_device"].values()),
                        "layout": _layout(plan),
                        "search_cpu_s": time.process_time() - t0,
                    }
                )
            # the default search (with or without ZB-V) is one of the families
            best = min((r for r in rows[1:] if r["family"] != "default - zbv"), key=lambda r: r["step_time_s"])
            for r in rows:
                r["vs_best"] = r["step_time_s"] / best["step_time_s"]
            cases.append({"cluster": cname, "global_batch": batch, "best": best["family"], "rows": rows})
            print(f"\n{cname}, global batch {batch}:\n{head}")
            for r in rows:
                got = r["schedule"] + (f" v{r['num_virtual_stages']}" if r["num_virtual_stages"] > 1 else "")
                print(
                    f"{r['family']:<23} {got:<16} {'yes' if r['runs_on_torch'] else 'no':<5} "
                    f"{r['step_time_s']:7.3f}s {r['vs_best']:7.3f}x {r['bubble_s']:7.3f}s "
                    f"{r['peak_memory_bytes'] / 2**30:6.1f} GiB  {r['layout']}",
                    flush=True,
                )
            fams = sorted((r for r in rows if r["schedule"] == r["family"]), key=lambda r: r["step_time_s"])
            runs = [r for r in fams if r["runs_on_torch"]]
            same = {r["family"]: r["step_time_s"] for r in rows}
            top = fams[0]["step_time_s"]
            ties = [r["family"] for r in fams[1:] if r["step_time_s"] <= top * (1 + 1e-9)]
            nxt = next((r for r in fams if r["step_time_s"] > top * (1 + 1e-9)), fams[-1])
            print(
                f"best: {fams[0]['family']}"
                + (f" (tied: {', '.join(ties)}: the same plan)" if ties else "")
                + f", {nxt['step_time_s'] / top - 1:.1%} ahead of {nxt['family']}"
                + (
                    f"; best that the torch runtime runs: {runs[0]['family']}"
                    if runs and runs[0] is not fams[0]
                    else ""
                )
                + f"; zb_h1 vs 1f1b in the same space: {same['zb_h1'] / same['1f1b same space'] - 1:+.1%}"
                + f", zbv: {same['zbv same space'] / same['1f1b same space'] - 1:+.1%}"
                + f"; default search chose {rows[0]['schedule']}"
            )
    res = {
        "model": MODEL[0],
        "seq_len": 2048,
        "max_micro_batch": 8,
        "default_schedules": list(SearchOptions().schedules),
        "cases": cases,
    }
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(res, indent=1, sort_keys=True) + "\n")
    return res


if __name__ == "__main__":
    main()
