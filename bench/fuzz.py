"""The long fuzzing run: the search and the parsers under many more random inputs than CI runs.

    python bench/fuzz.py [SEARCH_EXAMPLES] [PARSER_EXAMPLES]      (defaults 2000 and 5000)

Search: random IR graphs x random clusters x training configs x search options must give a valid
plan that fits by the search's own memory model, or an InfeasibleError (``tests/reliability/
random_graphs.check_search``). Parsers: random shorthand strings, cluster dicts and mutated or
truncated plan files must parse or raise a PartitaError. Any other outcome is a crash: hypothesis
shrinks it and this script prints the minimal input. Writes bench/results/fuzz.json.
"""

from __future__ import annotations

import json
import sys
import time
import traceback
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from partita.cluster import cluster_from_dict, parse_shorthand  # noqa: E402
from partita.errors import PartitaError  # noqa: E402
from partita.plan import Plan  # noqa: E402
from tests.reliability import random_graphs as rg  # noqa: E402
from tests.reliability.test_fuzz_parsers import json_values  # noqa: E402
from tests.test_plan import make_plan  # noqa: E402

OUT = ROOT / "bench" / "results" / "fuzz.json"


def run(name: str, examples: int, test_body, *strategies) -> dict:
    counts: Counter[str] = Counter()

    @settings(max_examples=examples, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(st.tuples(*strategies))
    def prop(args: tuple) -> None:
        counts[test_body(*args)] += 1

    t0 = time.perf_counter()
    crash = ""
    try:
        prop()
    except Exception:  # noqa: BLE001 - the point: report whatever escaped, with the shrunk input
        crash = traceback.format_exc(limit=8)
    row = {"name": name, "examples": sum(counts.values()), "outcomes": dict(counts), "crash": crash}
    row["time_s"] = round(time.perf_counter() - t0, 1)
    print(f"{name:<16} {row['examples']:>6} examples  {row['time_s']:>7.1f} s  {dict(counts)}  crash: {bool(crash)}")
    if crash:
        print(crash)
    return row


def _search(spec, cluster, training, options) -> str:
    return rg.check_search(rg.build(spec), cluster_from_dict(cluster, "fuzz cluster"), training, options)


def _shorthand(spec: str) -> str:
    try:
        parse_shorthand(spec)
    except PartitaError:
        return "error"
    return "ok"


def _cluster(d) -> str:
    try:
        cluster_from_dict(d)
    except PartitaError:
        return "error"
    return "ok"


PLAN_TEXT = make_plan().to_json()
SHORTHAND = st.lists(
    st.tuples(st.integers(-3, 40), st.sampled_from(["A100-80G", "V100", "L4", "CPU", "B200", "", "x"])),
    min_size=1,
    max_size=3,
).map(lambda terms: "+".join(f"{n}x{d}" for n, d in terms))
MUTATED_CLUSTER = (
    st.builds(
        lambda d, key, value: {**d, key: value},
        rg.cluster_dicts,
        st.sampled_from(["nodes", "network", "device_types", "name", "extra"]),
        json_values,
    )
    | rg.cluster_dicts
)


def _plan(cut: float, key: str, value) -> str:
    d = json.loads(PLAN_TEXT)
    d[key] = value
    text = json.dumps(d)
    text = text[: int(len(text) * cut)] if cut < 1 else text
    try:
        Plan.from_json(text)
    except PartitaError:
        return "error"
    return "ok"


def main() -> None:
    n_search = int(sys.argv[1]) if len(sys.argv) > 1 else 2000
    n_parse = int(sys.argv[2]) if len(sys.argv) > 2 else 5000
    rows = [
        run("search", n_search, _search, rg.graph_specs, rg.cluster_dicts, rg.trainings, rg.search_options),
        run("shorthand", n_parse, _shorthand, st.one_of(st.text(max_size=40), SHORTHAND)),
        run("cluster_dict", n_parse, _cluster, st.one_of(json_values, MUTATED_CLUSTER)),
        run(
            "plan_file",
            n_parse,
            _plan,
            st.sampled_from([0.3, 0.9, 0.999, 1.0]),
            st.sampled_from(sorted(json.loads(PLAN_TEXT))),
            json_values,
        ),
    ]
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({"rows": rows}, indent=1) + "\n")
    print(f"wrote {OUT}")
    sys.exit(1 if any(r["crash"] for r in rows) else 0)


if __name__ == "__main__":
    main()
