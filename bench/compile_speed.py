"""Cold compile of a model with no stored trace: a few blocks traced and expanded vs every block traced.

Issue 35 item 10. Each case runs ``partita compile MODEL --cluster 512xA100-80G+256xA100-40G+256xV100-32G
--global-batch 1536 --seq 2048 --out DIR --json`` in a fresh process with an empty compile cache and
``PARTITA_STORED_TRACES=off`` (no shipped graph: what any model of the user's own gets), twice in the
same run:

* ``blocks``: today's path: three of the repeated blocks traced and expanded to the full depth
  (``frontends/repeat.py``; for a model with no shallow builder, ``frontends/block_list.py``);
* ``full`` (the baseline): ``PARTITA_TRACE_BLOCKS=off``, every block traced by ``torch.export``, what
  a ``config.json`` model got before this change.

Models: gpt3-175b and llama-70b (zoo) and a Qwen2-7B-shape ``config.json`` (written here). The two
plan files of a case must be byte-identical. Wall, CPU (the child and its search workers, from
``os.wait4``) and the command's own trace / search seconds are recorded; the machine is shared, so
the load average at the start and end of each case is recorded too and CPU seconds are the
comparable number. Target: a cold compile within 12 s.

Usage: ``python bench/compile_speed.py [--quick]`` (``--quick``: the Qwen2-7B case only). Writes
``bench/results/compile_speed.json`` and prints a table.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).parent / "results"
OUT = RESULTS / "compile_speed.json"
CLUSTER = "512xA100-80G+256xA100-40G+256xV100-32G"
BATCH = 1536
TARGET_S = 12.0
QWEN2_7B = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "num_attention_heads": 28,
    "num_hidden_layers": 28,
    "num_key_value_heads": 4,
    "vocab_size": 152064,
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
    "_name_or_path": "qwen2-7b-shape",
}
PATHS = {"blocks": {}, "full": {"PARTITA_TRACE_BLOCKS": "off"}}


def compile_once(model: str, env_extra: dict[str, str], tmp: Path) -> dict[str, Any]:
    env = {**os.environ, "PARTITA_CACHE_DIR": str(tmp / "cache"), "PARTITA_STORED_TRACES": "off", **env_extra}
    env.setdefault("OMP_NUM_THREADS", "1")
    cmd = [sys.executable, "-m", "partita.cli", "compile", model, "--cluster", CLUSTER]
    cmd += ["--global-batch", str(BATCH), "--seq", "2048", "--out", str(tmp / "out"), "--json"]
    load0 = os.getloadavg()[0]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = proc.communicate()
    wall = time.perf_counter() - t0
    row: dict[str, Any] = {"rc": proc.returncode, "wall_s": round(wall, 2)}
    row["load_avg_1min"] = [round(load0, 2), round(os.getloadavg()[0], 2)]
    try:
        js = json.loads(out)
    except ValueError:
        js = {}
        row["message"] = " ".join(err.split())[-400:]
    row["trace_s"] = js.get("trace_time_s")
    row["search_s"] = js.get("search_time_s")
    row["trace_cpu_s"] = js.get("trace_cpu_s")
    row["search_cpu_s"] = js.get("search_cpu_s")  # the search's forked workers included
    row["step_time_s"] = js.get("predicted_step_time_s")
    plan = tmp / "out" / "plan.json"
    row["plan"] = plan.read_bytes() if plan.exists() else b""
    return row


def run_case(model: str, label: str) -> dict[str, Any]:
    import resource

    rows: dict[str, Any] = {}
    for name, extra in PATHS.items():
        with tempfile.TemporaryDirectory() as t:
            r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
            row = compile_once(model, extra, Path(t))
            r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
            row["cpu_s"] = round(r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime, 2)
            rows[name] = row
        print(f"  {label} {name}: {row['wall_s']} s wall, {row['cpu_s']} CPU s", file=sys.stderr)
    new, old = rows["blocks"], rows["full"]
    case = {
        "model": label,
        "cluster": CLUSTER,
        "global_batch": BATCH,
        "plans_identical": bool(new["plan"]) and new["plan"] == old["plan"],
        "wall_ratio": round(old["wall_s"] / new["wall_s"], 2),
        "cpu_ratio": round(old["cpu_s"] / new["cpu_s"], 2) if new["cpu_s"] else None,
    }
    for name, row in rows.items():
        row.pop("plan")
        case[name] = row
    return case


def table(result: dict[str, Any]) -> str:
    lines = [
        "| model | blocks: wall / CPU s | full trace: wall / CPU s | ratio wall / CPU | plans identical |",
        "|---|---|---|---|---|",
    ]
    for c in result["cases"]:
        b, f = c["blocks"], c["full"]
        lines.append(
            f"| {c['model']} | {b['wall_s']} / {b['cpu_s']} | {f['wall_s']} / {f['cpu_s']} | "
            f"x{c['wall_ratio']} / x{c['cpu_ratio']} | {c['plans_identical']} |"
        )
    lines.append(
        f"target: cold compile <= {TARGET_S} s on {CLUSTER}; load average (1 min) at the start and end of each "
        "compile is in the JSON: the machine is shared, CPU seconds are the comparable number"
    )
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    quick = "--quick" in argv
    with tempfile.TemporaryDirectory() as t:
        qwen = Path(t) / "qwen2-7b" / "config.json"
        qwen.parent.mkdir()
        qwen.write_text(json.dumps(QWEN2_7B))
        cases = [(str(qwen), "qwen2-7b-shape config.json")]
        if not quick:
            cases = [("gpt3-175b", "gpt3-175b"), ("llama-70b", "llama-70b"), *cases]
        result = {"cpus": os.cpu_count(), "cases": [run_case(m, label) for m, label in cases]}
    RESULTS.mkdir(exist_ok=True)
    OUT.write_text(json.dumps(result, indent=1) + "\n")
    print(table(result))
    return 0 if all(c["plans_identical"] for c in result["cases"]) else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
