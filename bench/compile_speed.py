"""Cold compile of a model with no stored trace: a few blocks traced and expanded vs every block traced.

Issue 35 item 10. Each case runs ``partita compile MODEL --cluster 512xA100-80G+256xA100-40G+256xV100-32G
--global-batch 1536 --seq 2048 --out DIR --json`` in a fresh process with an empty compile cache and
``PARTITA_STORED_TRACES=off`` (no shipped graph: what any model of the user's own gets), twice in the
same run:

* ``blocks``: today's path: three of the repeated blocks traced and expanded to the full depth
  (``frontends/repeat.py``; for a model with no shallow builder, ``frontends/block_list.py``);
* ``full`` (the baseline): ``PARTITA_TRACE_BLOCKS=off``, every block traced by ``torch.export``, what
  a ``config.json`` model got before this change.

Models: gpt3-175b and llama-70b (zoo) and the Qwen2-7B-shape and Qwen2-72B-shape (80 layers)
``config.json`` files of ``examples/configs``. The two plan files of a case must be byte-identical.
Wall, CPU (the child and its search workers, from ``getrusage`` of the children) and the command's own
trace / search CPU seconds are recorded, and the rest of the process ("other": imports, building the
model on meta, emitting the program, the report); beside them the CPU seconds of a process that only
imports torch, its exporter and transformers (the floor of any trace through ``torch.export``). The
machine is shared, so the load average at the start and end of each case is recorded too and CPU
seconds are the comparable number. Target: a cold compile within 12 s (not met: see the JSON).

``--against REF`` adds a third compile per case, ``before``: the same command (blocks path) run by the
code of git revision ``REF`` (``git archive`` into a temporary directory, put first on ``PYTHONPATH``),
so a speed-up of this code over an older one is a ratio measured in the same run; its plan must be
byte-identical too (``plans_identical_before``). ``--repeat N`` (with ``--against``) runs N - 1 more
(before, blocks) pairs, alternating, and records every sample and the ratio of the medians: on a
shared machine one compile's CPU seconds move by a second or more.

Usage: ``python bench/compile_speed.py [--quick] [--against REF [--repeat N]]`` (``--quick``: the two ``config.json``
cases). Writes ``bench/results/compile_speed.json`` (a case run again replaces its row; each row says
when it ran) and prints a table.
"""

from __future__ import annotations

import json
import os
import statistics
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
CONFIGS = Path(__file__).resolve().parent.parent / "examples" / "configs"
# the import floor of any torch.export path to a Hugging Face model: torch, its exporter, transformers' model
IMPORTS = "import torch, torch.export, torch._dynamo; from transformers.models.qwen2 import modeling_qwen2"
PATHS = {"blocks": {}, "full": {"PARTITA_TRACE_BLOCKS": "off"}}


def compile_once(model: str, env_extra: dict[str, str], tmp: Path) -> dict[str, Any]:
    env = {**os.environ, "PARTITA_CACHE_DIR": str(tmp / "cache"), "PARTITA_STORED_TRACES": "off", **env_extra}
    env.setdefault("OMP_NUM_THREADS", "1")
    cmd = [sys.executable, "-m", "partita.cli", "compile", model, "--cluster", CLUSTER]
    cmd += ["--global-batch", str(BATCH), "--seq", "2048", "--out", str(tmp / "out"), "--json"]
    load0 = os.getloadavg()[0]
    t0 = time.perf_counter()
    # run from the temporary directory: ``python -m`` puts the working directory first on sys.path, and
    # the code on PYTHONPATH (``--against``'s older tree) must be the partita imported
    proc = subprocess.Popen(cmd, env=env, cwd=tmp, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
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
    if row["plan"]:
        search = json.loads(row["plan"])["search"]
        row["layer_ilp_solves"] = search["ilp"]["num_solves"]
        row["stage_dp_runs"] = search["dp_runs"]
    return row


def _measured(model: str, extra: dict[str, str], label: str, name: str) -> dict[str, Any]:
    import resource

    with tempfile.TemporaryDirectory() as t:
        r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
        row = compile_once(model, extra, Path(t))
        r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
        row["cpu_s"] = round(r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime, 2)
        # the rest of the process: imports, building the model on meta, emitting the program, the report
        known = (row["trace_cpu_s"] or 0.0) + (row["search_cpu_s"] or 0.0)
        row["other_cpu_s"] = round(row["cpu_s"] - known, 2) if row["trace_cpu_s"] is not None else None
    print(f"  {label} {name}: {row['wall_s']} s wall, {row['cpu_s']} CPU s", file=sys.stderr)
    return row


def run_case(model: str, label: str, before: str | None = None, repeat: int = 1) -> dict[str, Any]:
    rows: dict[str, Any] = {}
    paths = dict(PATHS)
    if before is not None:  # the older code first on the path: its partita is the one imported
        paths["before"] = {"PYTHONPATH": os.pathsep.join([before, os.environ.get("PYTHONPATH", "")])}
    for name, extra in paths.items():
        rows[name] = _measured(model, extra, label, name)
    # --repeat: more (before, blocks) pairs, alternating, so that a neighbour's load falls on both
    samples: dict[str, list[dict[str, Any]]] = {"blocks": [rows["blocks"]], "before": [rows.get("before", {})]}
    for _ in range(repeat - 1 if before is not None else 0):
        for name in ("before", "blocks"):
            samples[name].append(_measured(model, paths[name], label, name))
    new, old = rows["blocks"], rows["full"]
    case = {
        "model": label,
        "cluster": CLUSTER,
        "global_batch": BATCH,
        "plans_identical": bool(new["plan"]) and new["plan"] == old["plan"],
        "wall_ratio": round(old["wall_s"] / new["wall_s"], 2),
        "cpu_ratio": round(old["cpu_s"] / new["cpu_s"], 2) if new["cpu_s"] else None,
    }
    if "before" in rows:
        b = rows["before"]
        case["plans_identical_before"] = all(
            bool(x["plan"]) and x["plan"] == new["plan"] for x in samples["before"] + samples["blocks"]
        )
        case["cpu_ratio_before"] = round(b["cpu_s"] / new["cpu_s"], 2) if new["cpu_s"] else None
        if repeat > 1:  # every sample's CPU seconds per phase, and the ratio of the medians
            for name, rs in samples.items():
                case[f"{name}_samples"] = [
                    {k: x[k] for k in ("cpu_s", "trace_cpu_s", "search_cpu_s", "other_cpu_s", "load_avg_1min")}
                    for x in rs
                ]
            med = {name: statistics.median(x["cpu_s"] for x in rs) for name, rs in samples.items()}
            case["cpu_median_before"], case["cpu_median_blocks"] = med["before"], med["blocks"]
            case["cpu_ratio_before_median"] = round(med["before"] / med["blocks"], 2) if med["blocks"] else None
    for rs in samples.values():
        for x in rs:
            x.pop("plan", None)
    for name, row in rows.items():
        row.pop("plan", None)
        case[name] = row
    return case


def table(result: dict[str, Any]) -> str:
    lines = (
        [
            f"this code against {result['against']} (same run): "
            + ", ".join(
                f"{c['model']}: {c.get('cpu_median_before', c['before']['cpu_s'])} -> "
                f"{c.get('cpu_median_blocks', c['blocks']['cpu_s'])} CPU s"
                f"{' (medians of ' + str(len(c['blocks_samples'])) + ')' if 'blocks_samples' in c else ''} "
                f"(x{c.get('cpu_ratio_before_median', c['cpu_ratio_before'])}, plans identical {c['plans_identical_before']})"
                for c in result["cases"]
                if "before" in c
            )
        ]
        if result.get("against")
        else []
    )
    lines += [
        "| model | blocks: wall / CPU s | CPU s: trace / search / other | full trace: wall / CPU s "
        "| ratio wall / CPU | plans identical |",
        "|---|---|---|---|---|---|",
    ]
    for c in result["cases"]:
        b, f = c["blocks"], c["full"]
        lines.append(
            f"| {c['model']} | {b['wall_s']} / {b['cpu_s']} | {b.get('trace_cpu_s', '-')} / "
            f"{b.get('search_cpu_s', '-')} / {b.get('other_cpu_s', '-')} | {f['wall_s']} / {f['cpu_s']} | x{c['wall_ratio']} / x{c['cpu_ratio']} | "
            f"{c['plans_identical']} |"
        )
    lines.append(
        f"target: cold compile <= {TARGET_S} s on {CLUSTER}. CPU seconds (user + sys of the compile and its "
        "search workers) are the comparable number: the machine is shared and its load average (1 min, start "
        "and end of each compile, in the JSON) moves wall seconds. 'other' = imports, model build, emit, report; "
        f"importing torch, its exporter and transformers alone takes {result['import_floor_cpu_s']} CPU s here"
    )
    return "\n".join(lines)


def import_floor() -> float:
    """CPU seconds of a fresh process that only imports what tracing a Hugging Face model needs."""
    import resource

    r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run([sys.executable, "-c", IMPORTS], check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    return round(r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime, 2)


def main(argv: list[str]) -> int:
    cases = [
        (str(CONFIGS / "qwen2-7b-shape.json"), "qwen2-7b-shape config.json"),
        (str(CONFIGS / "qwen2-72b-shape.json"), "qwen2-72b-shape config.json (80 layers)"),
    ]
    if "--quick" not in argv:
        cases = [("gpt3-175b", "gpt3-175b"), ("llama-70b", "llama-70b"), *cases]
    floor = import_floor()
    against = argv[argv.index("--against") + 1] if "--against" in argv else None
    repeat = int(argv[argv.index("--repeat") + 1]) if "--repeat" in argv else 1
    with tempfile.TemporaryDirectory() as before:
        if against is not None:  # the older code's tree (tracked files only), as git has it
            repo = Path(__file__).resolve().parent
            tar = subprocess.run(["git", "archive", against], cwd=repo, check=True, capture_output=True).stdout
            subprocess.run(["tar", "-x", "-C", before], input=tar, check=True)
        fresh = [
            {
                **run_case(m, label, before if against else None, repeat),
                "run_at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            }
            for m, label in cases
        ]
    old = json.loads(OUT.read_text())["cases"] if OUT.exists() else []
    labels = {c["model"] for c in fresh}
    result = {
        "cpus": os.cpu_count(),
        "import_floor_cpu_s": floor,
        "import_floor": IMPORTS,
        "against": against,
        "cases": [c for c in old if c["model"] not in labels] + fresh,
    }
    RESULTS.mkdir(exist_ok=True)
    OUT.write_text(json.dumps(result, indent=1) + "\n")
    print(table(result))
    return 0 if all(c["plans_identical"] and c.get("plans_identical_before", True) for c in fresh) else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
