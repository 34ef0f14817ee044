"""Intra-op search benchmark: ILP size, solve time and gap per (block, mesh, device type).

Run: ``python bench/intra_op.py``. Prints a table and writes ``bench/results/intra_op.json``.
Targets: a GPT-3 175B block (h=12288, 96 heads, seq 2048) on an (8, 8) mesh < 2 s; the whole
96-layer model < 5 s through the memo (one ILP for 96 identical blocks).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from partita.cluster import DEVICE_PRESETS  # noqa: E402
from partita.search.layer.intra_op import solve_layer  # noqa: E402
from partita.search.layer.memo import IntraOpMemo  # noqa: E402
from partita.search.pricing.cost_model import CostModel  # noqa: E402
from partita.search.pricing.mesh import LogicalMesh  # noqa: E402
from tests.search import builders  # noqa: E402

CASES = [
    ("gpt3-175b block", lambda: builders.gpt(1, 12288, 96), {"B": 8, "S": 2048}, (8, 8), ("dp", "tp"), "A100-80G"),
    ("gpt3-175b block", lambda: builders.gpt(1, 12288, 96), {"B": 8, "S": 2048}, (1, 8), ("dp", "tp"), "H100-80G"),
    ("gpt 4096 block", lambda: builders.gpt(1, 4096, 32), {"B": 16, "S": 2048}, (4, 8), ("dp", "tp"), "A100-80G"),
    ("mlp 1024x4096", lambda: builders.mlp(1024, 4096), {"B": 65536}, (8,), ("dp",), "A100-80G"),
    ("moe 8 experts", lambda: builders.moe(1024, 4096, 8, 2, 256), {"B": 16, "S": 1024}, (8,), ("dp",), "A100-80G"),
    (
        "moe 8 experts",
        lambda: builders.moe(1024, 4096, 8, 2, 256),
        {"B": 16, "S": 1024},
        (2, 4),
        ("dp", "ep"),
        "V100-32G",
    ),
]


def main() -> None:
    rows = []
    for name, build, env, shape, axes, dev_name in CASES:
        g = build()
        dev = DEVICE_PRESETS[dev_name]
        mesh = LogicalMesh(shape, axes, dev, 8)
        t0 = time.perf_counter()
        sol = solve_layer(g, g.layers[0], mesh, env=env, dtype="bf16", cost_model=CostModel(dev))
        wall = time.perf_counter() - t0
        s = sol.stats
        rows.append(
            {
                "block": name,
                "mesh": list(shape),
                "device": dev_name,
                "num_vars": s.num_vars,
                "num_constraints": s.num_constraints,
                "solve_s": s.solve_time_s,
                "total_s": wall,
                "gap": s.gap,
                "status": s.status,
                "backend": s.backend,
                "step_ms": sol.step_time_s * 1e3,
            }
        )
    g = builders.gpt(96, 12288, 96)
    mesh = LogicalMesh((8, 8), ("dp", "tp"), DEVICE_PRESETS["A100-80G"], 8)
    memo = IntraOpMemo()
    t0 = time.perf_counter()
    for layer in g.layers:
        memo.solve(g, layer, mesh, env={"B": 8, "S": 2048}, dtype="bf16", cost_model=CostModel(mesh.device))
    whole = time.perf_counter() - t0
    print(
        f"{'block':18} {'mesh':8} {'device':9} {'#vars':>6} {'#cons':>6} {'solve s':>8} {'total s':>8} "
        f"{'gap':>8} {'backend':7} {'step ms':>8}"
    )
    for r in rows:
        print(
            f"{r['block']:18} {str(tuple(r['mesh'])):8} {r['device']:9} {r['num_vars']:6d} "
            f"{r['num_constraints']:6d} {r['solve_s']:8.3f} {r['total_s']:8.3f} {r['gap']:8.1e} "
            f"{r['backend']:7} {r['step_ms']:8.2f}"
        )
    print(f"96-layer GPT-3 175B on (8, 8) A100: {whole:.2f} s, memo hits {memo.hits} misses {memo.misses}")
    out = {"cases": rows, "gpt3_96_layers": {"total_s": whole, "hits": memo.hits, "misses": memo.misses}}
    (ROOT / "bench" / "results").mkdir(parents=True, exist_ok=True)
    (ROOT / "bench" / "results" / "intra_op.json").write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
