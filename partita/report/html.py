"""The HTML view of a Plan: one self-contained page (pipeline timeline, memory against capacity,
time breakdown, layer map, run log).

Part of ``report/``; uses the terminal view's formatting helpers so both say the same numbers.
"""

from __future__ import annotations

import html
from collections.abc import Mapping
from typing import Any

from partita.plan import Plan
from partita.report.terminal import _bytes, _count, _mem_cap, _pct, _s, plan_text, run_log_text

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
