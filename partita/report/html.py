"""The HTML view of a Plan: one self-contained page (summary, pipeline schedule with a time axis and
legend, memory per device against capacity, time breakdown, layer-to-stage map, run log), or a
comparison page of two plans.

Part of ``report/``; formats through ``fmt.py`` like the terminal view, so both say the same
numbers. The charts are HTML boxes laid out by CSS (percent widths, wrapping text), so nothing is
clipped and the page reads at 700 px as at 1400 px; ``tests/test_report.py`` checks that in
headless Chromium by measuring element boxes.
"""

from __future__ import annotations

import html
import math
from collections.abc import Mapping, Sequence
from typing import Any

from partita.errors import PartitaError
from partita.plan import Plan
from partita.report.fmt import (
    cluster_devices,
    counts_text,
    devices_phrase,
    gib,
    mem_cap,
    pct,
    plural,
    time_s,
    used_devices,
)
from partita.report.run_log import gap_causes
from partita.report.run_log_view import collective_rows
from partita.report.terminal import compare_text, plan_text, schedule_losses
from partita.search.pipeline.pipeline_sim import simulate
from partita.search.pipeline.schedule import Action, pipeline_actions, splits_backward, virtual_stages
from partita.search.pipeline.schedule_cost import simulate_stages

_STAGE_COLORS = ["#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948", "#b07aa1", "#9c755f"]
_FWD, _BWD, _WGT = "#4e79a7", "#f28e2b", "#59a14f"
_KINDS = {"F": (_FWD, "forward"), "B": (_BWD, "input gradient (B)"), "W": (_WGT, "weight gradient (W)")}
MAX_MICRO_BATCHES_DRAWN = 32

_CSS = """
*{box-sizing:border-box} body{font-family:system-ui,sans-serif;margin:0 auto;padding:16px;max-width:1400px;
line-height:1.35;color:#222} h1{font-size:1.4em;overflow-wrap:anywhere} h2{font-size:1.15em;margin-top:1.6em}
.cards{display:flex;flex-wrap:wrap;gap:8px} .card{border:1px solid #ddd;border-radius:6px;padding:6px 10px;
min-width:140px;flex:1 1 140px} .card b{display:block;font-size:1.2em} .muted{color:#666;font-size:.9em}
table{border-collapse:collapse;width:100%} td,th{border:1px solid #ccc;padding:3px 6px;font-size:13px;
text-align:left;overflow-wrap:anywhere;vertical-align:top} figure.chart{margin:0}
.row{display:flex;align-items:center;gap:8px;margin:3px 0} .lab{flex:0 0 90px;font-size:12px;overflow-wrap:anywhere}
.track{position:relative;flex:1 1 auto;height:22px;background:#f1f1f1} .box{position:absolute;top:2px;bottom:2px}
.axis{position:relative;height:18px;margin-left:98px;font-size:11px;color:#444}
.tick{position:absolute;top:0;border-left:1px solid #888;padding-left:2px;height:18px;white-space:nowrap}
.tick.end{border-left:0;border-right:1px solid #888;padding-right:2px;transform:translateX(-100%)}
.legend{display:flex;flex-wrap:wrap;gap:4px 14px;font-size:12px;margin:6px 0}
.sw{display:inline-block;width:12px;height:12px;margin-right:4px;vertical-align:-2px;border:1px solid #999}
.memrow{margin:6px 0} .memrow .track{height:16px} .memtext{font-size:12px}
.stack{display:flex;height:22px;margin:4px 0} .stack div{height:100%}
.layers{display:flex;flex-wrap:wrap;gap:2px;margin:6px 0} .layer{width:14px;height:14px}
pre{font-size:12px;background:#f6f6f6;padding:8px;white-space:pre-wrap;overflow-wrap:anywhere}
.plans{display:grid;grid-template-columns:repeat(auto-fit,minmax(min(100%,560px),1fr));gap:24px}
"""


def _e(x: Any) -> str:
    return html.escape(str(x))


def _schedule(plan: Plan) -> tuple[list[tuple[int, Action, float, float]], float, int]:
    """(pipeline position, action, start, duration) boxes of one step's schedule, its end, and the
    number of micro-batches drawn: the plan's action list (``search/schedule.pipeline_actions``) run
    by the simulator that priced it (``search/pipeline_sim``) on the per-stage F, B, W times the plan
    records (``f_action_s`` ...; older plans: forward 1/3, backward 2/3 of compute, no W)."""
    n, v = plan.num_positions, virtual_stages(plan.schedule, plan.num_virtual_stages)
    # per rank group (a chunked plan's chunks carry their group's times split over them: summed back)
    groups = plan.positions()

    def per_group(key: str) -> list[float]:
        return [sum(float(s.predicted.get(key) or 0.0) for s in g) for g in groups]

    f_s, b_s, w_s = per_group("f_action_s"), per_group("b_action_s"), per_group("w_action_s")
    if not all(f > 0 for f in f_s):
        fwd = [
            float(s.predicted.get("forward_s", float(s.predicted.get("compute_s", 0.0) or 0.0) / 3) or 0)
            for s in (g[0] for g in groups)
        ]
        known = [f for f in fwd if f > 0]  # a stage without a predicted time is drawn at the others' mean
        f_s = [f if f > 0 else (sum(known) / len(known) if known else 1.0) for f in fwd]
        b_s, w_s = [2 * f for f in f_s], [0.0] * n
    m = min(plan.num_micro_batches, MAX_MICRO_BATCHES_DRAWN)
    while m > 1:  # interleaved 1F1B needs a micro-batch count its rounds divide
        try:
            pipeline_actions(plan.schedule, n, m, v)
            break
        except PartitaError:
            m -= 1
    chunks = sorted(plan.stages, key=lambda s: s.index)
    if plan.chunked and all(float(s.predicted.get("f_action_s") or 0.0) > 0 for s in chunks):
        # each chunk's own times (ZB-V's V layout prices its chunks unevenly: search/program/v_layout.py)
        f_c, b_c, w_c = (
            [float(s.predicted.get(k) or 0.0) for s in chunks] for k in ("f_action_s", "b_action_s", "w_action_s")
        )
        sim = simulate(plan.schedule, n, m, f_c, b_c, w_c, num_virtual=v)
    else:
        sim = simulate_stages(plan.schedule, m, v, f_s, b_s, w_s)
    boxes = [(b.rank, b.action, b.start_s, b.end_s - b.start_s) for b in sim.boxes]
    return boxes, sim.step_s or 1.0, m


def _ticks(end: float, num: int = 5) -> list[float]:
    """About ``num`` round tick values in [0, end]."""
    raw = end / num
    mag = 10 ** math.floor(math.log10(raw)) if raw > 0 else 1.0
    step = next(k * mag for k in (1, 2, 2.5, 5, 10) if k * mag >= raw)
    return [k * step for k in range(int(end / step) + 1)]


def timeline_html(plan: Plan) -> str:
    boxes, end, m = _schedule(plan)
    split, chunks, n = (
        splits_backward(plan.schedule),
        virtual_stages(plan.schedule, plan.num_virtual_stages),
        plan.num_positions,
    )
    rows = []
    for i in range(plan.num_positions):
        parts = []
        for si, act, start, dur in boxes:
            if si != i:
                continue
            what = _KINDS[act.kind][1] if split else ("forward" if act.kind == "F" else "backward")
            chunk = (
                f" (model chunk {act.stage // n if plan.schedule != 'zbv' else int(act.stage >= n)})"
                if chunks > 1
                else ""
            )
            parts.append(
                f'<div class="box" style="left:{100 * start / end:.3f}%;width:{100 * dur / end:.3f}%;'
                f'background:{_KINDS[act.kind][0]};border-right:1px solid #fff" '
                f'title="stage {i}{chunk}, micro-batch {act.micro}: {what} {time_s(dur)}"></div>'
            )
        dev = plan.stages[i].device_type
        rows.append(
            f'<div class="row"><div class="lab">stage {i}<br><span class="muted">{_e(dev)}</span></div>'
            f'<div class="track">{"".join(parts)}</div></div>'
        )
    ticks = []
    scale, unit = (1.0, "s") if end >= 2 else (1e3, "ms")
    for t in _ticks(end):
        frac = t / end
        cls = "tick end" if frac > 0.85 else "tick"
        v = round(t * scale, 6)
        digits = 0 if v.is_integer() else 1 if round(v * 10, 6).is_integer() else 2
        ticks.append(f'<div class="{cls}" style="left:{100 * frac:.3f}%">{v:,.{digits}f} {unit}</div>')
    shown = f"all {plural(m, 'micro-batch', 'micro-batches')}"
    if m < plan.num_micro_batches:
        shown = f"the first {m} of {plan.num_micro_batches} micro-batches"
    return (
        '<figure class="chart" id="timeline">'
        + "".join(rows)
        + f'<div class="axis">{"".join(ticks)}</div>'
        + '<div class="legend">'
        + "".join(
            f'<span><span class="sw" style="background:{_KINDS[k][0]}"></span>{_KINDS[k][1]} of one micro-batch</span>'
            for k in (("F", "B", "W") if split else ("F",))
        )
        + (
            ""
            if split
            else f'<span><span class="sw" style="background:{_BWD}"></span>backward of one micro-batch</span>'
        )
        + '<span><span class="sw" style="background:#f1f1f1"></span>idle (pipeline bubble)</span></div>'
        f'<figcaption class="muted">Time axis: the pipeline part of one step ({time_s(end)}, {shown}; '
        f"{plan.schedule}"
        + (f", {chunks} model chunks per stage" if chunks > 1 else "")
        + (", weight gradients deferred into the bubble" if split else "")
        + "; the action list the cost model simulated); the step adds the exposed gradient sync at its end"
        + (f" ({time_s(plan.predicted['tail_s'])})" if plan.predicted.get("tail_s") is not None else "")
        + ". Hover a box for its micro-batch.</figcaption></figure>"
    )


def memory_html(plan: Plan) -> str:
    rows = []
    top = max([float(s.predicted.get("memory_bytes") or 0) for s in plan.stages] + [1.0])
    for s in plan.stages:
        used, cap = float(s.predicted.get("memory_bytes") or 0), mem_cap(plan, s.device_type)
        full = cap or top
        color = "#e15759" if cap and used > cap else _STAGE_COLORS[s.index % len(_STAGE_COLORS)]
        text = f"{gib(used)} of {gib(cap)} per device ({pct(used / cap)})" if cap else f"{gib(used)} per device"
        if not s.predicted.get("memory_bytes"):
            text = "no memory prediction in the plan" + (f" (capacity {gib(cap)} per device)" if cap else "")
        rows.append(
            f'<div class="memrow"><div class="memtext">stage {s.index} ({_e(s.device_type)}): {text}</div>'
            f'<div class="track"><div class="box" style="left:0;top:0;bottom:0;'
            f'width:{min(100.0, 100 * used / full):.2f}%;background:{color}"></div></div></div>'
        )
    return (
        '<figure class="chart" id="memory">'
        + "".join(rows)
        + '<figcaption class="muted">Predicted peak memory per device; the grey track is the '
        "device's usable capacity.</figcaption></figure>"
    )


def breakdown_html(plan: Plan) -> str:
    p = plan.predicted
    total = float(p.get("step_time_s") or 0) or 1.0
    parts = [(k[:-2], float(p[k])) for k in ("compute_s", "communication_s", "bubble_s") if k in p]
    colors = ["#4e79a7", "#e15759", "#bab0ac"]
    bar = "".join(
        f'<div style="width:{100 * v / total:.2f}%;background:{c}" title="{k}"></div>'
        for (k, v), c in zip(parts, colors)
    )
    legend = "".join(
        f'<span><span class="sw" style="background:{c}"></span>{k}: {time_s(v)} ({pct(v / total)})</span>'
        for (k, v), c in zip(parts, colors)
    )
    return (
        f'<figure class="chart" id="breakdown"><div class="stack">{bar}</div><div class="legend">{legend}</div>'
        f'<figcaption class="muted">Per step, on the critical path; total {time_s(p.get("step_time_s"))}.'
        "</figcaption></figure>"
    )


def layermap_html(plan: Plan) -> str:
    cells, legend = [], []
    for s in plan.stages:
        c = _STAGE_COLORS[s.index % len(_STAGE_COLORS)]
        cells += [
            f'<div class="layer" style="background:{c}" title="{_e(lay)}: stage {s.index}"></div>' for lay in s.layers
        ]
        span = s.layers[0] if len(s.layers) == 1 else f"{s.layers[0]} .. {s.layers[-1]}"
        legend.append(
            f'<span><span class="sw" style="background:{c}"></span>stage {s.index}: {_e(span)} '
            f"({plural(len(s.layers), 'layer')}) on {len(s.ranks)} x {_e(s.device_type)}, "
            f"dp {s.dp} x tp {s.tp}{' (tp shards nothing: replicated)' if s.tp_shards_nothing else ''}, ZeRO-{s.zero_stage}, recompute {_e(s.recompute)}</span>"
        )
    return (
        f'<figure class="chart" id="layermap"><div class="layers">{"".join(cells)}</div>'
        f'<div class="legend">{"".join(legend)}</div><figcaption class="muted">One square per layer, '
        "in model order, coloured by its pipeline stage (hover for the name).</figcaption></figure>"
    )


def _cards(plan: Plan) -> str:
    p = plan.predicted
    total, used = cluster_devices(plan), used_devices(plan)
    idle = {k: n - used.get(k, 0) for k, n in total.items() if n > used.get(k, 0)}
    cards = [
        ("step time", f"{time_s(p.get('step_time_s'))}", "predicted, per step"),
        ("tokens / s", f"{p.get('tokens_per_s', 0):,.0f}", "predicted"),
        ("MFU", pct(p.get("mfu")), "vs peak of the devices used"),
        ("devices", devices_phrase(plan), counts_text(used) + (f"; not used: {counts_text(idle)}" if idle else "")),
        (
            "schedule",
            plan.schedule,
            f"{plural(plan.num_positions, 'stage')}, {plural(plan.num_micro_batches, 'micro-batch', 'micro-batches')} "
            f"of {plan.micro_batch_size} per replica" + schedule_losses(plan),
        ),
    ]
    return (
        '<div class="cards">'
        + "".join(
            f'<div class="card"><span class="muted">{_e(a)}</span><b>{_e(b)}</b><span class="muted">{_e(c)}</span></div>'
            for a, b, c in cards
        )
        + "</div>"
    )


def plan_section(plan: Plan, run_log: Mapping[str, Any] | None = None, key: str = "") -> str:
    """One plan's charts and tables (ids suffixed with ``key`` on a comparison page)."""
    body = (
        f"{_cards(plan)}<h2>Pipeline schedule of one step</h2>{timeline_html(plan)}"
        f"<h2>Memory per device against capacity</h2>{memory_html(plan)}"
        f"<h2>Time breakdown per step</h2>{breakdown_html(plan)}"
        f"<h2>Layer to stage map</h2>{layermap_html(plan)}"
        + (run_log_html(run_log) if run_log else "")
        + f"<details><summary>Full text report</summary><pre>{_e(plan_text(plan, run_log, width=80))}</pre></details>"
    )
    return body.replace('id="', f'id="{key}') if key else body


_SELF_CHECK = """<script>
// Self-check: every chart drew boxes; the result is readable in the DOM (tests/test_report.py).
const charts = Array.from(document.querySelectorAll("figure.chart"));
const ok = charts.length >= 4 && charts.every(c => c.querySelectorAll("div").length > 0);
document.body.setAttribute("data-charts", ok ? "ok" : "missing");
</script>"""


def _page(title: str, body: str) -> str:
    return (
        '<!doctype html>\n<html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>{_e(title)}</title><style>{_CSS}</style></head><body>\n<h1>{_e(title)}</h1>\n{body}\n"
        f"{_SELF_CHECK}\n</body></html>\n"
    )


def plan_html(plan: Plan, run_log: Mapping[str, Any] | None = None) -> str:
    title = f"Partita plan: {plan.model.get('name')} on {plan.cluster.get('name')} ({devices_phrase(plan)})"
    return _page(title, plan_section(plan, run_log))


def compare_html(plans: Sequence[Plan], logs: Sequence[Mapping[str, Any] | None] = ()) -> str:
    """Two plans on one page: the comparison table, then each plan's charts side by side (stacked
    when the window is narrow)."""
    a, b = plans[0], plans[1]
    logs = list(logs) + [None] * (2 - len(logs))
    cols = "".join(
        f'<section id="plan-{k}"><h2>Plan {k}: {_e(p.model.get("name"))} on {_e(p.cluster.get("name"))}</h2>'
        f"{plan_section(p, log, key=f'{k}-')}</section>"
        for k, p, log in zip("AB", plans, logs)
    )
    return _page(
        f"Partita: {a.model.get('name')} on {a.cluster.get('name')} (A) vs "
        f"{b.model.get('name')} on {b.cluster.get('name')} (B)",
        f'<pre id="compare">{_e(compare_text(a, b, width=80))}</pre><div class="plans">{cols}</div>',
    )


def _ticked(text: str) -> str:
    """Escaped text with its `backticked` parts as <code>."""
    parts = str(text).split("`")
    return "".join(f"<code>{_e(p)}</code>" if k % 2 else _e(p) for k, p in enumerate(parts))


def run_log_html(log: Mapping[str, Any]) -> str:
    """The run log section: predicted vs measured, likely causes of a large gap, collectives."""
    st = log.get("step_time_s") or {}
    head = (
        f"<tr><td>step time (per step)</td><td>{time_s(st.get('predicted'))}</td>"
        f"<td>{time_s(st.get('measured_median'))}</td><td>{pct(st.get('error'), signed=True)}</td></tr>"
    )
    causes = "".join(f"<li>{_ticked(c)}. Fix: {_ticked(f)}.</li>" for c, f in gap_causes(log))
    coll = "".join("<tr>" + "".join(f"<td>{_e(x)}</td>" for x in r) + "</tr>" for r in collective_rows(log))
    return (
        '<h2>Predicted vs measured</h2><table id="runlog"><tr><th>what</th><th>predicted</th>'
        f"<th>measured (median)</th><th>error</th></tr>{head}</table>"
        + (f'<p>Likely causes of the gap:</p><ul id="runlog-causes">{causes}</ul>' if causes else "")
        + '<h3>Collectives per step</h3><table id="runlog-collectives"><tr><th>stage</th><th>kind</th>'
        "<th>predicted #</th><th>measured #</th><th>predicted bytes</th><th>measured bytes</th><th>match</th></tr>"
        f"{coll}</table>"
    )
