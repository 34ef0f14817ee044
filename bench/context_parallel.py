"""Context parallelism priced (issue 36): hand layouts with and without ``cp`` through ``partita evaluate``'s path.

* Llama 3.1 405B (``examples/configs/llama-3.1-405b.json``) at 131,072 tokens on 16,384 H100-80G: the
  layout Llama 3 trained with (TP 8, CP 16, PP 16, DP 8, micro-batch 1, global batch 128 = 16M tokens;
  arXiv:2407.21783 Table 4, published 380 TFLOP/s per GPU), under each recompute choice; and the same
  devices without context parallelism (TP 8, PP 16, DP 128), for which 131,072 tokens per micro-batch
  must fit on one rank;
* Llama-2 7B's shape with 65,536 positions (``examples/configs/llama-2-7b-64k.json``) at 65,536 tokens on
  64 H100-80G, global batch 16: tp 8 with dp 8 / cp 1 against the same 64 devices split dp x cp.

Each row is ``search.entry.evaluate.evaluate_config`` (the torch program's tp style, as ``partita
evaluate`` prices a torch model), so the numbers are the CLI's. Writes ``bench/results/context_parallel.json``
and prints a table: step time, whether it fits, the largest stage's memory, MFU, and each row's speed-up
over its group's baseline, priced in the same run: the fastest layout without context parallelism (cp 1)
that fits in memory (none in the 405B group: there the first row, the published layout, is the baseline).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from partita.cluster import parse_cluster
from partita.driver import trace_model
from partita.errors import ConfigError
from partita.search.entry.evaluate import evaluate_config, tp_style_of
from partita.search.pricing.config import TrainingConfig

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "results" / "context_parallel.json"
GROUPS = {
    "llama-3.1-405b @131072 on 16384xH100-80G, batch 128": (
        "examples/configs/llama-3.1-405b.json",
        "16384xH100-80G",
        TrainingConfig(global_batch=128, seq_len=131072),
        [
            dict(tp=8, pp=16, dp=8, cp=16, micro_batch=1, zero_stage=1, recompute="none"),
            dict(tp=8, pp=16, dp=8, cp=16, micro_batch=1, zero_stage=1, recompute="selective"),
            dict(tp=8, pp=16, dp=8, cp=16, micro_batch=1, zero_stage=1, recompute="full"),
            dict(tp=8, pp=16, dp=128, cp=1, micro_batch=1, zero_stage=1, recompute="full"),
        ],
    ),
    "llama-2-7b shape @65536 on 64xH100-80G, batch 16": (
        "examples/configs/llama-2-7b-64k.json",
        "64xH100-80G",
        TrainingConfig(global_batch=16, seq_len=65536),
        [
            dict(tp=8, pp=1, dp=8 // c, cp=c, micro_batch=1, zero_stage=1, recompute=r)
            for c in (1, 2, 4, 8)
            for r in ("none", "selective", "full")
        ],
    ),
}


def main() -> dict:
    rows = []
    for group, (model, cluster, tr, layouts) in GROUPS.items():
        t0 = time.perf_counter()
        graph = trace_model(str(ROOT / model), seq=tr.seq_len).graph
        cl = parse_cluster(cluster)
        evs = []
        for lay in layouts:
            try:
                ev = evaluate_config(graph, cl, tr, tp_style=tp_style_of(graph), **lay)
            except ConfigError as e:
                rows.append({"group": group, **lay, "refused": str(e).splitlines()[0]})
                continue
            evs.append((lay, ev))
        fitting = [ev.predicted_step_time_s for lay, ev in evs if lay["cp"] == 1 and ev.fits]
        base = min(fitting) if fitting else evs[0][1].predicted_step_time_s
        for lay, ev in evs:
            rows.append(
                {
                    "group": group,
                    **lay,
                    "step_s": ev.predicted_step_time_s,
                    "speedup_vs_baseline": base / ev.predicted_step_time_s,
                    "baseline": "fastest cp=1 layout that fits" if fitting else "the group's first row",
                    "fits": ev.fits,
                    "max_memory_gib": max(ev.memory_per_device) / 2**30,
                    "capacity_gib": ev.memory_capacity / 2**30,
                    "mfu": ev.mfu,
                    "bubble_s": ev.bubble_s,
                    "notes": list(ev.notes),
                }
            )
        print(f"{group}: {time.perf_counter() - t0:.0f} s")
    OUT.write_text(json.dumps({"rows": rows}, indent=1) + "\n")
    print(
        f"{'group':52} {'tp/pp/dp/cp':>12} {'recompute':>9} {'step s':>8} {'speedup':>7} {'fits':>5} {'GiB':>7} {'MFU':>6}"
    )
    for r in rows:
        lay = f"{r['tp']}/{r['pp']}/{r['dp']}/{r['cp']}"
        if "refused" in r:
            print(f"{r['group'][:52]:52} {lay:>12} {r['recompute']:>9}  refused: {r['refused']}")
            continue
        print(
            f"{r['group'][:52]:52} {lay:>12} {r['recompute']:>9} {r['step_s']:8.3f} {r['speedup_vs_baseline']:7.3f} "
            f"{'yes' if r['fits'] else 'NO':>5} {r['max_memory_gib']:7.1f} {r['mfu']:6.1%}"
        )
    return {"rows": rows}


if __name__ == "__main__":
    main()
