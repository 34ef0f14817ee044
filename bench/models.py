"""Every architecture family at a realistic size: trace time, exact parameter count, compile time.

For each family of ``partita/models/families.py`` at hidden 2048, 16 layers, 16 heads (8 kv heads),
ffn 5632, vocab 32000, the config.json is written to a temporary directory and taken the way a user's
would be (``partita compile DIR``):

* trace: ``driver.trace_model(DIR)`` (``torch.export`` on the meta device, passes); the traced
  graph's parameter count must equal the model's (``sum(p.numel())`` on the meta build, tied once);
* compile: ``driver.compile_to_dir(DIR, CLUSTER, ...)`` (search + program), no cache, for a mixed
  cluster (8 A100-80G + 8 V100-32G by default), global batch 64 x seq 2048.

Writes ``bench/results/models.json`` and prints a table. ``--families a,b`` limits the run;
``--no-compile`` traces only. Numbers depend on the machine's load (2 shared cores here).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from partita.driver import compile_to_dir, trace_model
from partita.errors import PartitaError
from partita.models import families, resolve_model
from partita.search.pricing.config import TrainingConfig

OUT = Path(__file__).parent / "results" / "models.json"
CLUSTER = "8xA100-80G+8xV100-32G"
TRAINING = TrainingConfig(global_batch=64, seq_len=2048, dtype="bf16")


def measure(family: str, root: Path, cluster: str, compile_: bool) -> dict[str, Any]:
    spec = str(families.write_config(root / family, families.realistic(family)))
    row: dict[str, Any] = {"family": family}
    handle = resolve_model(spec)
    row["params"] = handle.num_params()
    t0 = time.perf_counter()
    traced = trace_model(spec, batch=1, seq=min(2048, int(handle.config.get("seq_len") or 2048)))
    row["trace_s"] = round(time.perf_counter() - t0, 2)
    row["traced_params"] = traced.graph.num_params()
    row["params_exact"] = row["traced_params"] == row["params"]
    row["layers"] = len(traced.graph.layers)
    row["nodes"] = len(traced.graph.nodes)
    if traced.graph.meta.get("no_pipeline"):  # the search keeps such a model to one stage (passes/boundaries.py)
        row["no_pipeline"] = traced.graph.meta["no_pipeline"]
    if compile_:
        t0 = time.perf_counter()
        try:
            out = compile_to_dir(spec, cluster, TRAINING, root / f"{family}-out", force=True)
            plan = out.plan
            row["compile_s"] = round(time.perf_counter() - t0, 2)
            row["stages"] = plan.num_stages
            row["device_types"] = sorted({s.device_type for s in plan.stages})
            row["step_time_s"] = plan.predicted.get("step_time_s")
        except PartitaError as err:
            row["compile_s"] = round(time.perf_counter() - t0, 2)
            row["error"] = str(err).splitlines()[0][:160]
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", default=",".join(families.FAMILIES))
    ap.add_argument("--cluster", default=CLUSTER)
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--out", default=str(OUT))
    ap.add_argument("--merge", action="store_true", help="keep rows of other families already in --out")
    args = ap.parse_args(argv)
    out = Path(args.out)
    rows = []
    if args.merge and out.exists():  # keep the rows of earlier runs for families not measured now
        rows = [r for r in json.loads(out.read_text())["rows"] if r["family"] not in args.families.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        for fam in args.families.split(","):
            try:
                row = measure(fam, Path(tmp), args.cluster, not args.no_compile)
            except PartitaError as err:
                row = {"family": fam, "params": 0, "params_exact": False, "layers": 0, "nodes": 0, "trace_s": "-"}
                row["error"] = str(err).splitlines()[0][:160]
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
            out.write_text(json.dumps({"cluster": args.cluster, "training": vars(TRAINING), "rows": rows}, indent=1))
    rows.sort(key=lambda r: families.FAMILIES.index(r["family"]))
    print(
        f"{'family':<10} {'params':>14} {'exact':>5} {'layers':>6} {'nodes':>6} {'trace s':>8} {'compile s':>9}  plan"
    )
    for r in rows:
        plan = r.get("error") or f"{r.get('stages', '-')} stage(s) on {','.join(r.get('device_types', []))}"
        plan += " (not pipelined: a cut would carry an input-derived tensor)" if r.get("no_pipeline") else ""
        print(
            f"{r['family']:<10} {r['params']:>14,} {str(r['params_exact']):>5} {r['layers']:>6} {r['nodes']:>6} "
            f"{r['trace_s']:>8} {r.get('compile_s', '-'):>9}  {plan}"
        )
    out.write_text(json.dumps({"cluster": args.cluster, "training": vars(TRAINING), "rows": rows}, indent=1))
    return 0 if all(r["params_exact"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
