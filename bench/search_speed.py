"""Search wall time across model sizes, GPU counts and device-type counts. Writes bench/results/search_speed.json."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from gpt_graphs import gpt_graph  # noqa: E402

from partita.cluster import parse_cluster  # noqa: E402
from partita.search.config import TrainingConfig  # noqa: E402
from partita.search.planner import plan_graph  # noqa: E402

OUT = Path(__file__).parent / "results" / "search_speed.json"
CASES = [
    ("gpt3-1.3b", (2048, 16, 24), "8xA100-80G"),
    ("gpt3-6.7b", (4096, 32, 32), "32xA100-80G+32xV100-32G"),
    ("gpt3-39b", (8192, 64, 48), "128xA100-80G+64xV100-32G+64xL4"),
    ("gpt3-175b", (12288, 96, 96), "512xH100-80G+256xA100-80G+256xV100-32G"),
]


def main() -> None:
    rows = []
    for name, dims, cname in CASES[: int(sys.argv[1]) if len(sys.argv) > 1 else None]:
        g = gpt_graph(*dims, 2048)
        cl = parse_cluster(cname)
        t0 = time.perf_counter()
        plan = plan_graph(g, cl, TrainingConfig(global_batch=1536, seq_len=2048))
        dt = time.perf_counter() - t0
        rows.append(
            {
                "model": name,
                "cluster": cname,
                "num_gpus": cl.num_devices,
                "search_s": dt,
                "step_time_s": plan.predicted["step_time_s"],
                "num_candidates": plan.search["num_candidates"],
                "dp_runs": plan.search["dp_runs"],
                "ilp_solves": plan.search["ilp"]["num_solves"],
            }
        )
        print(
            f"{name:<10} {cname:<42} {cl.num_devices:>5} GPUs  search {dt:6.1f} s  step {rows[-1]['step_time_s']:.2f} s",
            flush=True,
        )
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(rows, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
