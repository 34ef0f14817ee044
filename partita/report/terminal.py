"""Terminal views of a Plan and of a run log: rich tables rendered to deterministic text.

Part of ``report/`` (top of the flow, under the CLI and driver): reads only the Plan (and a run log
next to it when one exists), so a report can be made on any machine from ``plan.json``. Text
output is deterministic (fixed width, no colour) so it is golden-tested.
"""

from __future__ import annotations

import io
import json
from collections.abc import Mapping
from typing import Any

from rich.console import Console
from rich.table import Table

from partita.plan import Plan

WIDTH = 110


def _s(x: Any, unit: str = "s") -> str:
    if x is None:
        return "-"
    x = float(x)
    if unit == "s":
        return f"{x * 1e3:.1f} ms" if x < 1 else f"{x:.3f} s"
    if unit == "B":
        return f"{x / 2**30:.2f} GiB"
    if unit == "%":
        return f"{100 * x:.1f}%"
    return f"{x:.3g}"


def _render(*tables: Any) -> str:
    buf = io.StringIO()
    con = Console(file=buf, width=WIDTH, color_system=None, force_terminal=False, legacy_windows=False)
    for t in tables:
        con.print(t)
    return buf.getvalue().rstrip() + "\n"


def _mem_cap(plan: Plan, device_type: str) -> float | None:
    for g in plan.cluster.get("spec", {}).get("groups", []):
        if g["device"]["name"] == device_type:
            return float(g["device"]["memory_bytes"])
    return None


def summary_table(plan: Plan) -> Table:
    p = plan.predicted
    t = Table(
        title=f"Plan for {plan.model.get('name')} on {plan.cluster.get('name')} ({plan.world_size} devices)",
        show_header=False,
    )
    t.add_column("what")
    t.add_column("value")
    tr = plan.training
    t.add_row("predicted step time", _s(p.get("step_time_s")))
    t.add_row("tokens / s", f"{p.get('tokens_per_s', 0):,.0f}")
    t.add_row("MFU (vs cluster peak)", _s(p.get("mfu"), "%"))
    t.add_row(
        "global batch x seq",
        f"{tr.get('global_batch')} x {tr.get('seq_len')} ({tr.get('dtype')}, {tr.get('optimizer')})",
    )
    t.add_row(
        "schedule",
        f"{plan.schedule}, {plan.num_micro_batches} micro-batches of {plan.micro_batch_size}"
        f" per replica" + (f", {plan.num_virtual_stages} virtual stages" if plan.num_virtual_stages > 1 else ""),
    )
    headroom = []
    for s in plan.stages:
        cap, used = _mem_cap(plan, s.device_type), s.predicted.get("memory_bytes")
        if cap and used:
            headroom.append(f"stage {s.index}: {_s(cap - used, 'B')}")
    t.add_row("memory headroom", ", ".join(headroom) or "-")
    return t


def stages_table(plan: Plan) -> Table:
    t = Table(title="Stages")
    for c in (
        "stage",
        "layers",
        "device",
        "ranks",
        "mesh dp x tp",
        "ZeRO",
        "recompute",
        "batch shares",
        "compute",
        "comm",
        "memory/device",
    ):
        t.add_column(c)
    for s in plan.stages:
        layers = s.layers[0] if len(s.layers) == 1 else f"{s.layers[0]} .. {s.layers[-1]} ({len(s.layers)})"
        ranks = f"{s.ranks[0]}-{s.ranks[-1]}" if len(s.ranks) > 1 else str(s.ranks[0])
        cap = _mem_cap(plan, s.device_type)
        mem = _s(s.predicted.get("memory_bytes"), "B") + (f" / {_s(cap, 'B')}" if cap else "")
        t.add_row(
            str(s.index),
            layers,
            s.device_type,
            ranks,
            f"{s.dp} x {s.tp}",
            str(s.zero_stage),
            s.recompute,
            ":".join(map(str, s.batch_shares)) or "even",
            _s(s.predicted.get("compute_s")),
            _s(s.predicted.get("comm_s")),
            mem,
        )
    return t


def breakdown_table(plan: Plan) -> Table:
    p = plan.predicted
    total = float(p.get("step_time_s") or 0) or 1.0
    t = Table(title="Time breakdown (critical path)")
    for c in ("part", "time", "share"):
        t.add_column(c)
    for k in ("compute_s", "communication_s", "bubble_s"):
        if k in p:
            t.add_row(k[:-2], _s(p[k]), _s(float(p[k]) / total, "%"))
    return t


def alternatives_table(plan: Plan) -> Table:
    t = Table(title="Top alternatives and why they lost")
    for c in ("alternative", "step time", "why it lost"):
        t.add_column(c)
    for a in plan.search.get("alternatives", []):
        t.add_row(str(a.get("summary", "")), _s(a.get("step_time_s")), str(a.get("why", "")))
    return t


def search_table(plan: Plan) -> Table:
    s = plan.search
    t = Table(title="Search statistics", show_header=False)
    t.add_column("what")
    t.add_column("value")
    for k in sorted(s):
        if k in ("alternatives",):
            continue
        v = s[k]
        if isinstance(v, (list, dict)):
            v = json.dumps(v, sort_keys=True)[:200]
        t.add_row(k, str(v))
    return t


def plan_text(plan: Plan, run_log: Mapping[str, Any] | None = None) -> str:
    """The plan's tables; with a run log, its "Predicted vs measured" tables after them."""
    tables = [summary_table(plan), stages_table(plan), breakdown_table(plan), alternatives_table(plan)]
    tables.append(search_table(plan))
    if run_log:
        tables += run_log_tables(run_log)
    return _render(*tables)


def compare_text(a: Plan, b: Plan) -> str:
    t = Table(title="Plan comparison")
    t.add_column("")
    t.add_column("A")
    t.add_column("B")
    rows = [
        ("model", a.model.get("name"), b.model.get("name")),
        ("cluster", a.cluster.get("name"), b.cluster.get("name")),
        ("step time", _s(a.predicted.get("step_time_s")), _s(b.predicted.get("step_time_s"))),
        ("tokens / s", f"{a.predicted.get('tokens_per_s', 0):,.0f}", f"{b.predicted.get('tokens_per_s', 0):,.0f}"),
        ("stages", str(a.num_stages), str(b.num_stages)),
        ("schedule", f"{a.schedule} m={a.num_micro_batches}", f"{b.schedule} m={b.num_micro_batches}"),
        (
            "meshes",
            " | ".join(f"{s.device_type} {s.dp}x{s.tp}" for s in a.stages),
            " | ".join(f"{s.device_type} {s.dp}x{s.tp}" for s in b.stages),
        ),
    ]
    for r in rows:
        t.add_row(*[str(x) for x in r])
    ta, tb = a.predicted.get("step_time_s"), b.predicted.get("step_time_s")
    verdict = ""
    if ta and tb:
        faster, ratio = ("A", tb / ta) if ta <= tb else ("B", ta / tb)
        verdict = f"{faster} is faster by {100 * (ratio - 1):.1f}%\n"
    return _render(t) + verdict


# ---- HTML ----------------------------------------------------------------------------------
def _pct(x: Any) -> str:
    return "-" if x is None else f"{100 * float(x):+.1f}%"


def _count(e: Mapping[str, Any] | None) -> str:
    return "-" if not e else str(int(e.get("count") or 0))


def _bytes(e: Mapping[str, Any] | None) -> str:
    if not e or e.get("bytes") is None:
        return "-"
    b = float(e["bytes"])
    return f"{b / 2**20:.2f} MiB" if b >= 2**20 else f"{b / 2**10:.1f} KiB"


def run_log_tables(log: Mapping[str, Any]) -> list[Table]:
    """ "Predicted vs measured" from a run log (``DIR/run_log.json``, written by ``partita run DIR``)."""
    st = log.get("step_time_s") or {}
    measured = st.get("measured") or []
    t = Table(title=f"Predicted vs measured ({log.get('framework')} run, {log.get('steps')} steps)")
    for c in ("what", "predicted", "measured", "error"):
        t.add_column(c)
    med = st.get("measured_median")
    how = f" (median of {len(measured)})" if measured else " (not measured)"
    t.add_row("step time", _s(st.get("predicted")), _s(med) + how, _pct(st.get("error")))
    for s in log.get("stages", []):
        m = s.get("measured_time_s")
        err = (m - s["predicted_time_s"]) / s["predicted_time_s"] if m and s.get("predicted_time_s") else None
        t.add_row(f"stage {s['index']} time", _s(s.get("predicted_time_s")), _s(m), _pct(err))
    losses, ref = log.get("losses") or [], log.get("reference_losses")
    if losses:
        diff = max(abs(a - b) for a, b in zip(losses, ref)) if ref else None
        t.add_row(
            "losses",
            f"reference {ref[0]:.4f} -> {ref[-1]:.4f}" if ref else "-",
            f"{losses[0]:.4f} -> {losses[-1]:.4f}",
            f"max |diff| {diff:.1e}" if diff is not None else "-",
        )
    src = "in the compiled HLO" if log.get("collective_source") == "hlo" else "at run time, first rank per stage"
    c = Table(title=f"Collectives per step, predicted vs measured (counted {src})")
    for col in ("stage", "kind", "predicted #", "measured #", "predicted bytes", "measured bytes", "match"):
        c.add_column(col)
    for s in log.get("stages", []):
        for kind, row in s.get("collectives", {}).items():
            pred, meas = row.get("predicted"), row.get("measured")
            same = (
                "-"
                if not s.get("collectives_measured")
                else "yes"
                if _count(pred) == (_count(meas) if meas else "0")
                else "NO"
            )
            c.add_row(str(s["index"]), kind, _count(pred), _count(meas) if s.get("collectives_measured") else "-",
                      _bytes(pred), _bytes(meas), same)  # fmt: skip
    gaps = Table(title="Not measured by this run", show_header=False)
    gaps.add_column("gap")
    for g in log.get("gaps", []):
        gaps.add_row(str(g))
    return [t, c, gaps]


def run_log_text(log: Mapping[str, Any]) -> str:
    return _render(*run_log_tables(log))
