"""Search reports: what the plan chose and why, as terminal tables and one self-contained HTML page.

Reads only the Plan (and a run log next to it when one exists), so a report can be made on any
machine from ``plan.json``. Top layer: called by the CLI (``partita report``) and the driver.
Text output is deterministic (fixed width, no colour) so it is golden-tested.
"""

from __future__ import annotations

import html
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
_COLORS = ["#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948", "#b07aa1", "#ff9da7"]


def _timeline_svg(plan: Plan) -> str:
    """1F1B / GPipe schedule per stage and micro-batch from the predicted stage times."""
    n, m = plan.num_stages, min(plan.num_micro_batches, 32)
    fwd = [float(s.predicted.get("forward_s", s.predicted.get("compute_s", 1.0)) or 1.0) / 3 for s in plan.stages]
    bwd = [2 * f for f in fwd]
    # Simulate the schedule: each stage has an ordered list of (kind, micro-batch).
    orders = []
    for i in range(n):
        if plan.schedule == "gpipe":
            order = [("F", j) for j in range(m)] + [("B", j) for j in range(m)]
        else:
            warm = min(n - i, m)
            order = [("F", j) for j in range(warm)]
            f_next, b_next = warm, 0
            while b_next < m:
                order.append(("B", b_next))
                b_next += 1
                if f_next < m:
                    order.append(("F", f_next))
                    f_next += 1
        orders.append(order)
    done: dict[tuple[str, int, int], float] = {}
    pos = [0] * n
    clock = [0.0] * n
    boxes = []
    progress = True
    while progress:
        progress = False
        for i in range(n):
            while pos[i] < len(orders[i]):
                kind, j = orders[i][pos[i]]
                dep = (
                    ("F", i - 1, j)
                    if kind == "F" and i > 0
                    else ("B", i + 1, j)
                    if kind == "B" and i < n - 1
                    else ("F", i, j)
                    if kind == "B"
                    else None
                )
                if dep is not None and dep not in done:
                    break
                start = max(clock[i], done.get(dep, 0.0) if dep else 0.0)
                dur = fwd[i] if kind == "F" else bwd[i]
                done[(kind, i, j)] = start + dur
                clock[i] = start + dur
                boxes.append((i, kind, j, start, dur))
                pos[i] += 1
                progress = True
    end = max(clock) or 1.0
    w, row = 900, 28
    sx = w / end
    parts = [
        f'<svg class="chart" id="timeline" width="{w + 90}" height="{n * row + 30}" xmlns="http://www.w3.org/2000/svg">'
    ]
    for i in range(n):
        parts.append(f'<text x="0" y="{i * row + 18}" font-size="12">stage {i}</text>')
    for i, kind, j, start, dur in boxes:
        color = _COLORS[j % len(_COLORS)]
        opacity = "1" if kind == "F" else "0.55"
        parts.append(
            f'<rect x="{80 + start * sx:.1f}" y="{i * row + 4}" width="{max(dur * sx - 1, 1):.1f}" '
            f'height="{row - 8}" fill="{color}" fill-opacity="{opacity}"><title>{kind}{j} stage {i}'
            f"</title></rect>"
        )
    parts.append(
        f'<text x="80" y="{n * row + 22}" font-size="11">forward (solid) and backward (light) per '
        f"micro-batch; {m} of {plan.num_micro_batches} micro-batches shown</text></svg>"
    )
    return "".join(parts)


def _bars_svg(ident: str, items: list[tuple[str, float, float | None]], unit: str) -> str:
    w, row = 700, 26
    top = max([max(v, c or 0) for _, v, c in items] + [1e-9])
    parts = [
        f'<svg class="chart" id="{ident}" width="{w + 260}" height="{len(items) * row + 10}" '
        f'xmlns="http://www.w3.org/2000/svg">'
    ]
    for k, (label, v, cap) in enumerate(items):
        y = k * row + 4
        parts.append(f'<text x="0" y="{y + 14}" font-size="12">{html.escape(label)}</text>')
        if cap:
            parts.append(f'<rect x="180" y="{y}" width="{cap / top * w:.1f}" height="{row - 8}" fill="#ddd"/>')
        parts.append(
            f'<rect x="180" y="{y}" width="{v / top * w:.1f}" height="{row - 8}" fill="{_COLORS[k % len(_COLORS)]}"/>'
        )
        txt = _s(v, unit) + (f" / {_s(cap, unit)}" if cap else "")
        parts.append(f'<text x="{185 + max(v, cap or 0) / top * w:.1f}" y="{y + 14}" font-size="11">{txt}</text>')
    parts.append("</svg>")
    return "".join(parts)


def plan_html(plan: Plan, run_log: Mapping[str, Any] | None = None) -> str:
    mem = [
        (
            f"stage {s.index} ({s.device_type})",
            float(s.predicted.get("memory_bytes", 0) or 0),
            _mem_cap(plan, s.device_type),
        )
        for s in plan.stages
    ]
    p = plan.predicted
    brk = [(k[:-2], float(p[k]), None) for k in ("compute_s", "communication_s", "bubble_s") if k in p]
    layer_rows = "".join(
        f"<tr><td>{html.escape(lay)}</td><td>{s.index}</td><td>{html.escape(s.device_type)}</td>"
        f"<td>{s.dp} x {s.tp}</td></tr>"
        for s in plan.stages
        for lay in s.layers
    )
    text = html.escape(plan_text(plan))
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>Partita plan: {html.escape(str(plan.model.get("name")))}</title>
<style>body{{font-family:sans-serif;margin:2em;max-width:1100px}} table{{border-collapse:collapse}}
td,th{{border:1px solid #ccc;padding:2px 8px;font-size:13px}} pre{{font-size:12px;background:#f6f6f6;padding:1em}}
</style></head><body>
<h1>Partita plan: {html.escape(str(plan.model.get("name")))} on {html.escape(str(plan.cluster.get("name")))}</h1>
<p>Predicted step time <b>{_s(p.get("step_time_s"))}</b>, {p.get("tokens_per_s", 0):,.0f} tokens/s,
MFU {_s(p.get("mfu"), "%")}, {plan.world_size} devices, {plan.num_stages} stages, {plan.schedule}.</p>
<h2>Pipeline schedule</h2>{_timeline_svg(plan)}
<h2>Memory per device against capacity</h2>{_bars_svg("memory", mem, "B")}
<h2>Time breakdown</h2>{_bars_svg("breakdown", brk, "s")}
<h2>Layer to stage map</h2><table id="layermap"><tr><th>layer</th><th>stage</th><th>device</th><th>mesh</th></tr>
{layer_rows}</table>
{run_log_html(run_log) if run_log else ""}
<h2>Full report</h2><pre>{text}</pre>
<script>
// Self-check: every chart must have drawn shapes; the result is readable in the DOM.
const charts = Array.from(document.querySelectorAll("svg.chart"));
const ok = charts.length >= 3 && charts.every(c => c.querySelectorAll("rect").length > 0);
document.body.setAttribute("data-charts", ok ? "ok" : "missing");
</script>
</body></html>
"""


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


def run_log_html(log: Mapping[str, Any]) -> str:
    """The run log section of the HTML page: the same tables, as a table element per part."""
    st = log.get("step_time_s") or {}
    rows = [("step time", _s(st.get("predicted")), _s(st.get("measured_median")), _pct(st.get("error")))]
    coll = "".join(
        f"<tr><td>{s['index']}</td><td>{html.escape(kind)}</td><td>{_count(r.get('predicted'))}</td>"
        f"<td>{_count(r.get('measured')) if s.get('collectives_measured') else '-'}</td>"
        f"<td>{_bytes(r.get('predicted'))}</td><td>{_bytes(r.get('measured'))}</td></tr>"
        for s in log.get("stages", [])
        for kind, r in s.get("collectives", {}).items()
    )
    head = "".join(f"<tr><td>{a}</td><td>{b}</td><td>{c}</td><td>{d}</td></tr>" for a, b, c, d in rows)
    return (
        '<h2>Predicted vs measured</h2><table id="runlog"><tr><th>what</th><th>predicted</th><th>measured (median)'
        f"</th><th>error</th></tr>{head}</table>"
        '<h3>Collectives per step</h3><table id="runlog-collectives"><tr><th>stage</th><th>kind</th>'
        "<th>predicted #</th><th>measured #</th><th>predicted bytes</th><th>measured bytes</th></tr>"
        f"{coll}</table><pre>{html.escape(run_log_text(log))}</pre>"
    )
