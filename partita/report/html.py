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
    group_busy,
    nbytes,
    pct,
    plural,
    stage_count_phrase,
    stage_memory,
    time_in,
    time_s,
    time_unit,
    used_devices,
    utilization_text,
)
from partita.report.run_log import gap_causes
from partita.report.run_log_view import collective_rows
from partita.report.terminal import (
    SCHEDULE_NAMES,
    choice_notes,
    compare_text,
    hand_layout_table,
    plan_text,
    schedule_losses,
    tokens_per_s,
)
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
.track{position:relative;flex:1 1 auto;height:22px;background:#f1f1f1} .box{position:absolute;top:2px;bottom:2px;font-size:10px;line-height:18px;color:#fff;text-align:center;white-space:nowrap}
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


MIN_TRACK_PX = 500  # the chart's track at a 700 px window (page padding, row label): labels sized for it
_CHAR_PX, _PAD_PX = 6.5, 4.0  # a 10 px digit or letter, and the box's margins


def box_label(micro: int, stage: int | None, frac: float) -> str:
    """The text inside a pipeline-chart box: its micro-batch (``3``), and its stage where a rank group
    runs several (``3 s2``); empty when it would not fit a box ``frac`` of the track wide at
    :data:`MIN_TRACK_PX` (the tooltip says it all the same)."""
    text = f"{micro}" if stage is None else f"{micro} s{stage}"
    return text if frac * MIN_TRACK_PX >= _CHAR_PX * len(text) + _PAD_PX else ""


def timeline_html(plan: Plan, axis_end: float | None = None) -> str:
    """The pipeline chart; ``axis_end`` (seconds): draw on that axis instead of the plan's own end, so
    two plans on one page share a time axis (``compare_html``)."""
    boxes, end, m = _schedule(plan)
    own_end = end
    shared = axis_end is not None and axis_end > end
    end = float(axis_end) if shared and axis_end is not None else end
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
            chunk = (act.stage // n if plan.schedule != "zbv" else int(act.stage >= n)) if chunks > 1 else 0
            stage = act.stage if chunks > 1 else i  # the plan's stage index: one vocabulary with the tables
            faded = ";opacity:0.55" if chunk % 2 else ""  # a rank group's stages told apart (chunk 1, 3 lighter)
            text = box_label(act.micro, stage if chunks > 1 else None, dur / end)
            parts.append(
                f'<div class="box" data-stage="{stage}" style="left:{100 * start / end:.3f}%;'
                f"width:{100 * dur / end:.3f}%;background:{_KINDS[act.kind][0]};border-right:1px solid #fff"
                f'{faded}" title="stage {stage} (rank group {i}), micro-batch {act.micro}: {what} {time_s(dur)}">'
                f"{text}</div>"
            )
        group = plan.positions()[i]
        dev = ", ".join(dict.fromkeys(s.device_type for s in group))
        label = f"group {i}" if chunks > 1 else f"stage {i}"
        sub = f"stages {', '.join(str(s.index) for s in group)}<br>" if chunks > 1 else ""
        rows.append(
            f'<div class="row"><div class="lab">{label}<br><span class="muted">{sub}{_e(dev)}</span></div>'
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
        + (
            f'<span><span class="sw" style="background:{_FWD};opacity:0.55"></span>lighter: the rank group\'s '
            "later stage (model chunk 1)</span>"
            if chunks > 1
            else ""
        )
        + '<span><span class="sw" style="background:#f1f1f1"></span>idle (pipeline bubble)</span></div>'
        f'<figcaption class="muted">Time axis: the pipeline part of one step ({time_s(own_end)}, {shown}; '
        f"{plan.schedule}"
        + (f", {stage_count_phrase(plan)}; a row per rank group" if chunks > 1 else "")
        + ("; the axis is shared with the other plan on this page" if shared else "")
        + (", weight gradients deferred into the bubble" if split else "")
        + "; the action list the cost model simulated); the step adds the exposed gradient sync at its end"
        + (f" ({time_s(plan.predicted['tail_s'])})" if plan.predicted.get("tail_s") is not None else "")
        + ". A box wide enough says its micro-batch"
        + (" and stage (3 s2: micro-batch 3 of stage 2)" if chunks > 1 else "")
        + "; hover any box for its micro-batch, stage and time.</figcaption></figure>"
    )


def memory_html(plan: Plan) -> str:
    """Per stage and device type: predicted peak per device against the usable capacity the search
    held it under, and its parts (parameters, gradients, optimizer state, activations)."""
    rows = []
    top = max([float(s.predicted.get("memory_bytes") or 0) for s in plan.stages] + [1.0])
    for s in plan.stages:
        cats = s.predicted.get("memory_by_category")
        parts = (
            ", ".join(f"{k.replace('_', ' ')} {nbytes(v)}" for k, v in cats.items() if float(v) > 0)
            if isinstance(cats, Mapping)
            else ""
        )
        beyond = s.predicted.get("memory_beyond_tensors") or {}
        for dev, mem, cap in stage_memory(plan, s):
            it = beyond.get(dev)
            extra = (
                f"; beyond tensors: CUDA context {nbytes(it['cuda_context'])}, NCCL buffers "
                f"{nbytes(it['nccl_buffers'])}, allocator margin {nbytes(it['allocator_margin'])}: "
                f"{nbytes(it['total'])} of the device"
                if it
                else ""
            )
            used = mem or 0.0
            full = cap or top
            color = "#e15759" if cap and used > cap else _STAGE_COLORS[s.index % len(_STAGE_COLORS)]
            text = (
                f"{gib(used)} of {gib(cap)} usable per device ({pct(used / cap)}; {gib(cap - used)} headroom)"
                if cap
                else f"{gib(used)} per device"
            )
            if not mem:
                text = "no memory prediction in the plan" + (f" (usable {gib(cap)} per device)" if cap else "")
            rows.append(
                f'<div class="memrow"><div class="memtext">stage {s.index} ({_e(dev)}): {text}</div>'
                f'<div class="track"><div class="box" style="left:0;top:0;bottom:0;'
                f'width:{min(100.0, 100 * used / full):.2f}%;background:{color}"></div></div>'
                + (f'<div class="muted">{_e(parts + extra)}</div>' if parts or extra else "")
                + "</div>"
            )
    return (
        '<figure class="chart" id="memory">'
        + "".join(rows)
        + '<figcaption class="muted">Predicted peak memory per device, per device type where a stage spans '
        "several; the grey track is the device's usable capacity: the share of its memory the search let "
        "plans use (the allocator and context keep the rest).</figcaption></figure>"
    )


def breakdown_html(plan: Plan) -> str:
    p = plan.predicted
    busy = utilization_text(plan) if plan.num_positions > 1 else ""
    unit = time_unit([p.get(k) for k in ("step_time_s", "compute_s", "communication_s", "bubble_s")])
    total = float(p.get("step_time_s") or 0) or 1.0
    parts = [(k[:-2], float(p[k])) for k in ("compute_s", "communication_s", "bubble_s") if k in p]
    colors = ["#4e79a7", "#e15759", "#bab0ac"]
    bar = "".join(
        f'<div style="width:{100 * v / total:.2f}%;background:{c}" title="{k}"></div>'
        for (k, v), c in zip(parts, colors)
    )
    legend = "".join(
        f'<span><span class="sw" style="background:{c}"></span>{k}: {time_in(v, unit)} ({pct(v / total)})</span>'
        for (k, v), c in zip(parts, colors)
    )
    return (
        f'<figure class="chart" id="breakdown"><div class="stack">{bar}</div><div class="legend">{legend}</div>'
        f'<figcaption class="muted">Per step, on the critical path (the busiest stage: its bubble is the time it '
        f"waits); total {time_s(p.get('step_time_s'))}."
        + (f" Off that path rank groups wait longer: {_e(busy)} of the step." if busy else "")
        + "</figcaption></figure>"
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
        "in model order, coloured by its stage (hover for the name).</figcaption></figure>"
    )


def _cards(plan: Plan) -> str:
    p = plan.predicted
    total, used = cluster_devices(plan), used_devices(plan)
    idle = {k: n - used.get(k, 0) for k, n in total.items() if n > used.get(k, 0)}
    cards = [
        ("step time", f"{time_s(p.get('step_time_s'))}", "predicted, per step"),
        ("tokens / s", f"{tokens_per_s(plan):,.0f}", "predicted"),
        ("MFU", pct(p.get("mfu")), "vs peak of the devices used"),
        ("devices", devices_phrase(plan), counts_text(used) + (f"; not used: {counts_text(idle)}" if idle else "")),
        (
            "schedule",
            plan.schedule,
            f"{stage_count_phrase(plan)}, {plural(plan.num_micro_batches, 'micro-batch', 'micro-batches')} "
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


def flops_utilization(plan: Plan) -> dict[str, float]:
    """Per device type: the model FLOPs its devices run per step (each stage's ``predicted["flops"]``,
    per device, times its devices; a rank group's model chunks summed) over their peak in the plan's
    dtype for the step (the peak rule of ``cluster.DeviceType.flops``). Types in a stage whose dp
    replicas span several types, and plans without FLOP records, are left out (per-replica FLOPs are
    not recorded)."""
    from partita.cluster import DeviceType

    peaks: dict[str, float] = {}
    for g in plan.cluster.get("spec", {}).get("groups", []):
        try:
            peaks[str(g["device"]["name"])] = DeviceType(**g["device"]).flops(str(plan.training.get("dtype", "bf16")))
        except (TypeError, KeyError):
            continue
    step = float(plan.predicted.get("step_time_s") or 0.0)
    done: dict[str, float] = {}
    mixed: set[str] = set()
    for st in plan.stages:
        if st.replica_device_types:
            mixed.update(st.replica_device_types)
            continue
        f = st.predicted.get("flops")
        if f is None:
            return {}
        done[st.device_type] = done.get(st.device_type, 0.0) + float(f) * len(st.ranks)
    used = used_devices(plan)
    return {
        t: v / (used[t] * peaks[t] * step)
        for t, v in done.items()
        if t not in mixed and used.get(t) and peaks.get(t) and step > 0
    }


def utilization_html(plan: Plan) -> str:
    """Per device type: devices used of the cluster's, and the share of the step its rank groups work."""
    total, used = cluster_devices(plan), used_devices(plan)
    busy: dict[str, list[float]] = {}
    for _r, _idx, types, share in group_busy(plan):
        for t in types:
            if share is not None:
                busy.setdefault(t, []).append(share)
    rows = []
    by_flops = flops_utilization(plan)
    for dev in dict.fromkeys([*used, *total]):
        n, have = used.get(dev, 0), total.get(dev, used.get(dev, 0))
        shares = busy.get(dev)
        work = (
            "idle: " + str((plan.predicted.get("idle_reasons") or {}).get(dev, "not used by the plan"))
            if not n
            else (f"{pct(min(shares))}" + (f" to {pct(max(shares))}" if max(shares) != min(shares) else ""))
            if shares
            else "-"
        )
        mfu = pct(by_flops[dev]) if dev in by_flops else "-"
        rows.append(f"<tr><td>{_e(dev)}</td><td>{n} of {have}</td><td>{_e(work)}</td><td>{_e(mfu)}</td></tr>")
    return (
        '<table id="utilization"><tr><th>device type</th><th>devices used</th>'
        "<th>share of the step its rank groups work (the rest: waiting, gradient sync)</th>"
        "<th>MFU of the type</th></tr>"
        + "".join(rows)
        + "</table>"
        + '<p class="muted">MFU of the type: the model FLOPs its devices run per step over their peak in the '
        + "plan's dtype (-: not recorded, for a stage whose data-parallel replicas span types or a plan with no FLOP records).</p>"
    )


def why_html(plan: Plan) -> str:
    """Why this plan: the runner-up plans and what each lost on, the schedules searched, the best hand
    layout, the idle device types and why, and the precision choice, in the open (not only in the
    collapsed text)."""
    items = []
    for a in list(plan.search.get("alternatives") or [])[:3]:
        items.append(f"<li><code>{_e(a.get('summary', ''))}</code>: {time_s(a.get('step_time_s'))}; "
                     f"{_e(a.get('why', ''))}</li>")  # fmt: skip
    sched = schedule_losses(plan)
    if sched:
        items.append(f"<li>schedules searched ({_e(plan.schedule)} chosen){_e(sched)}</li>")
    hand = hand_layout_table(plan)
    if hand is not None and hand.caption:
        items.append(f"<li>best hand layout: {_e(hand.caption)}</li>")
    for dev, why in sorted((plan.predicted.get("idle_reasons") or {}).items()):
        items.append(f"<li>{_e(dev)} idle: {_e(why)}</li>")
    prec = (
        (plan.predicted.get("precision") or {}).get("why")
        if isinstance(plan.predicted.get("precision"), Mapping)
        else None
    )
    if prec:
        items.append(f"<li>precision: {_e(prec)}</li>")
    for what, why in choice_notes(plan):  # issue 36: context parallelism, fp8
        items.append(f"<li>{_e(what)}: {_e(why)}</li>")
    names = [f"<b>{_e(k)}</b>: {_e(v)}" for k, v in SCHEDULE_NAMES.items() if k == plan.schedule]
    if names:
        items.append(f"<li>{names[0]}</li>")
    return f'<ul id="why">{"".join(items) or "<li>the plan records no alternatives</li>"}</ul>'


def next_html(plan: Plan, out_dir: str | None = None) -> str:
    """The commands to run next on this plan's directory."""
    d = out_dir or "OUT"
    cmds = [
        (f"partita rehearse {d}", "the program at full size on a fake process group, checked against the plan"),
        (f"partita run {d} --steps 3 --reference", "train a few steps here and compare with a single-device run"),
        (f"partita report {d} --html page.html", "this page again (with the run log once a run wrote one)"),
    ]
    groups = (plan.cluster.get("spec") or {}).get("groups") or ()
    if len(groups) <= 1 and all(int(g.get("num_nodes", 1)) == 1 for g in groups):  # one node: one launch line
        cmds.insert(
            1, (f"torchrun --nproc-per-node {plan.world_size} {d}/program_torch.py --steps 100", "train with the plan")
        )
    return '<ul id="next">' + "".join(f"<li><code>{_e(c)}</code>: {_e(w)}</li>" for c, w in cmds) + "</ul>"


def plan_section(
    plan: Plan,
    run_log: Mapping[str, Any] | None = None,
    key: str = "",
    axis_end: float | None = None,
    out_dir: str | None = None,
) -> str:
    """One plan's charts and tables (ids prefixed with ``key`` on a comparison page; ``axis_end``: a
    pipeline-chart time axis shared with the other plan)."""
    body = (
        f"{_cards(plan)}<h2>Why this plan</h2>{why_html(plan)}"
        f"<h2>Pipeline schedule of one step</h2>{timeline_html(plan, axis_end)}"
        f"<h2>Device types: used and busy</h2>{utilization_html(plan)}"
        f"<h2>Memory per device against usable capacity</h2>{memory_html(plan)}"
        f"<h2>Time breakdown per step</h2>{breakdown_html(plan)}"
        f"<h2>Layer to stage map</h2>{layermap_html(plan)}"
        f"<h2>Next</h2>{next_html(plan, out_dir)}"
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


def plan_html(plan: Plan, run_log: Mapping[str, Any] | None = None, out_dir: str | None = None) -> str:
    title = f"Partita plan: {plan.model.get('name')} on {plan.cluster.get('name')} ({devices_phrase(plan)})"
    return _page(title, plan_section(plan, run_log, out_dir=out_dir))


def compare_html(plans: Sequence[Plan], logs: Sequence[Mapping[str, Any] | None] = (), dirs: Sequence[str] = ()) -> str:
    """Two plans on one page: the comparison table, then each plan's charts side by side (stacked
    when the window is narrow), their pipeline charts on one time axis (the longer step's)."""
    a, b = plans[0], plans[1]
    logs = list(logs) + [None] * (2 - len(logs))
    outs = list(dirs) + [None] * (2 - len(dirs))
    end = max(_schedule(p)[1] for p in plans)
    cols = "".join(
        f'<section id="plan-{k}"><h2>Plan {k}: {_e(p.model.get("name"))} on {_e(p.cluster.get("name"))}</h2>'
        f"{plan_section(p, log, key=f'{k}-', axis_end=end, out_dir=d)}</section>"
        for k, p, log, d in zip("AB", plans, logs, outs)
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
