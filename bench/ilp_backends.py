"""Benchmark the OR-Tools backends on the strategy-selection ILP (``partita/search/layer/ilp.py``).

Run: ``python bench/ilp_backends.py [--quick]``. Problems: the real GPT-3 175B block on an (8, 8)
mesh (as built by ``search/layer/intra_op.py``) and synthetic Alpa-style problems (N vertices x 6
strategies, chain + skip edges every 4 vertices, memory knapsack at 60% of the replicated total).
Prints objective, bound, gap, status and time per backend; writes ``bench/results/ilp_backends.json``.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from partita.cluster import DEVICE_PRESETS  # noqa: E402
from partita.search import ilp  # noqa: E402
from partita.search.layer.intra_op import _LayerProblem  # noqa: E402
from partita.search.pricing.cost_model import CostModel  # noqa: E402
from partita.search.pricing.mesh import LogicalMesh  # noqa: E402
from tests.search import builders  # noqa: E402

BACKENDS = ("highs", "scip", "cbc", "cpsat")


def synthetic(n: int, k: int = 6, seed: int = 0) -> ilp.Problem:
    rng = np.random.default_rng(seed)
    costs = tuple(rng.uniform(1e-4, 1e-3, k) for _ in range(n))
    mems = tuple(rng.uniform(1e8, 1e9, k) for _ in range(n))
    pairs = [(i, i + 1) for i in range(n - 1)] + [(i, i + 4) for i in range(0, n - 4, 4)]
    edges = tuple(ilp.Edge(u, v, rng.uniform(0, 1e-3, (k, k)) * (rng.random((k, k)) > 0.3)) for u, v in pairs)
    budget = 0.6 * sum(float(m.max()) for m in mems)
    return ilp.Problem(costs, edges, mems, budget)


def gpt3_block() -> ilp.Problem:
    g = builders.gpt(1, 12288, 96)
    dev = DEVICE_PRESETS["A100-80G"]
    mesh = LogicalMesh((8, 8), ("dp", "tp"), dev, 8)
    lp = _LayerProblem(g, g.layers[0], mesh, {"B": 8, "S": 2048}, "bf16", "adam", CostModel(dev), ("S(0)", "R"))
    lp.build_groups()
    return lp.build_problem(dev.memory_bytes)


def main() -> None:
    quick = "--quick" in sys.argv
    limit = 10.0 if quick else 30.0
    cases = [("gpt3-175b block (8,8)", gpt3_block()), ("synthetic N=60", synthetic(60))]
    if not quick:
        cases.append(("synthetic N=200", synthetic(200)))
    rows = []
    print(f"{'problem':24} {'backend':7} {'status':9} {'objective':>12} {'bound':>12} {'gap':>9} {'time s':>8}")
    for name, p in cases:
        for be in BACKENDS:
            t0 = time.perf_counter()
            try:
                s = ilp.solve(p, be, time_limit_s=limit).stats
            except Exception as e:  # noqa: BLE001 - a failing backend is a result, not a crash
                print(f"{name:24} {be:7} error: {e}")
                continue
            wall = time.perf_counter() - t0
            rows.append(
                {
                    "problem": name,
                    "backend": be,
                    "status": s.status,
                    "objective": s.objective,
                    "bound": s.bound,
                    "gap": s.gap,
                    "time_s": wall,
                    "num_vars": s.num_vars,
                }
            )
            print(f"{name:24} {be:7} {s.status:9} {s.objective:12.6e} {s.bound:12.6e} {s.gap:9.2e} {wall:8.2f}")
    (ROOT / "bench" / "results").mkdir(parents=True, exist_ok=True)
    (ROOT / "bench" / "results" / "ilp_backends.json").write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
