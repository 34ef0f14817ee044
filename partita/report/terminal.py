"""Terminal views of a Plan (and of ``partita evaluate`` / ``partita trace`` results): rich tables
rendered to plain text.

Part of ``report/`` (top of the flow, under the CLI and driver): reads only the Plan (and a run log
next to it when one exists), so a report can be made on any machine from ``plan.json``. The text
fits the terminal's width (``$COLUMNS``, else the TTY's size, else a fixed 110 columns, so files and
goldens are deterministic); narrow columns wrap, never truncate. Every number says its unit and
whether it is per micro-batch or per step.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from rich.table import Table

from partita.plan import Plan
from partita.report.fmt import (
    cluster_devices,
    counts_text,
    devices_phrase,
    gib,
    mem_cap,
    output_width,
    pct,
    plural,
    time_s,
    used_devices,
)
from partita.report.run_log_view import run_log_tables
from partita.report.tables import render, table
from partita.search.pipeline.schedule import splits_backward

ONE_TABLE_WIDTH = 150  # at least this wide: the stages fit one table; narrower: two


# ---- a plan ------------------------------------------------------------------------------------
def summary_table(plan: Plan) -> Table:
    p, tr = plan.predicted, plan.training
    rows = [
        ["predicted step time", f"{time_s(p.get('step_time_s'))} per step"],
        ["tokens / s", f"{p.get('tokens_per_s', 0):,.0f}"],
        ["MFU (vs peak of the devices used)", pct(p.get("mfu"))],
        [
            "global batch x seq",
            f"{tr.get('global_batch')} x {tr.get('seq_len')} ({tr.get('dtype')}, {tr.get('optimizer')})",
        ],
        [
            "schedule",
            f"{plan.schedule}, {plural(plan.num_micro_batches, 'micro-batch', 'micro-batches')} of "
            f"{plural(plan.micro_batch_size, 'sample')} per replica, {plural(plan.num_positions, 'stage')}"
            + (f", {plan.num_virtual_stages} virtual stages" if plan.num_virtual_stages > 1 else "")
            + (", weight gradients (W) deferred into the bubble" if splits_backward(plan.schedule) else "")
            + schedule_losses(plan),  # issue 19: how much each other schedule family searched loses
        ],
    ]
    total, used = cluster_devices(plan), used_devices(plan)
    idle = {k: n - used.get(k, 0) for k, n in total.items() if n > used.get(k, 0)}
    dev = f"{counts_text(used)} used"
    if idle:
        why = "a hand-made layout" if "hand_layout" in plan.search else "the search found no faster plan that uses them"
        dev += f"; not used: {counts_text(idle)} ({why})"
    rows.append(["devices", dev])
    if "mfu_cluster" in p:  # issue 18's cost model records these; one row each so each reads on its own
        idle_note = " (over half the cluster idle)" if p.get("mostly_idle") else ""
        rows.append(["MFU (vs peak of the whole cluster)", f"{pct(p['mfu_cluster'])}{idle_note}"])
        rows.append(["precision", str((p.get("precision") or {}).get("why", "-"))])
        rows.append(["network", str(p.get("network", "-"))])
    headroom = []
    for s in plan.stages:
        cap, mem = mem_cap(plan, s.device_type), s.predicted.get("memory_bytes")
        if cap and mem:
            headroom.append(f"stage {s.index}: {gib(cap - mem)}")
    rows.append(["memory headroom per device", ", ".join(headroom) or "-"])
    name = f"Plan for {plan.model.get('name')} on {plan.cluster.get('name')} ({devices_phrase(plan)})"
    return table(name, ["what", "value"], rows, show_header=False)


def _stage_layers(layers: Sequence[str]) -> str:
    return layers[0] if len(layers) == 1 else f"{layers[0]} .. {layers[-1]} ({len(layers)} layers)"


def _stage_layout_rows(plan: Plan) -> list[list[str]]:
    rows = []
    for s in plan.stages:
        ranks = f"{s.ranks[0]}-{s.ranks[-1]}" if len(s.ranks) > 1 else str(s.ranks[0])
        rows.append(
            [
                str(s.index),
                _stage_layers(s.layers),
                s.device_type,
                ranks,
                f"{s.dp} x {s.tp}"
                + (" SP" if "sequence_parallel" in s.tp_plan.values() else "")  # Megatron SP
                + (" (tp shards nothing: replicated)" if s.tp_shards_nothing else ""),
                str(s.zero_stage),
                s.recompute,
                ":".join(map(str, s.batch_shares)) or "even",
            ]
        )
    return rows


def _stage_cost_rows(plan: Plan) -> list[list[str]]:
    rows = []
    for s in plan.stages:
        cap = mem_cap(plan, s.device_type)
        mem = gib(s.predicted.get("memory_bytes")) + (f" of {gib(cap)}" if cap else "")
        rows.append(
            [
                time_s(s.predicted.get("compute_s")),
                time_s(s.predicted.get("comm_s")),
                time_s(s.predicted.get("tail_s")),
                mem,
            ]
        )
    return rows


_LAYOUT = ["stage", "layers", "device", "ranks", "dp x tp", "ZeRO", "recompute", "batch shares"]
_COST = ["compute per micro-batch", "comm per micro-batch", "grad sync at step end", "memory per device"]
_STAGES_CAPTION = (
    "per micro-batch: one forward + backward of one micro-batch on the stage; grad sync at step end: the "
    "exposed part of the gradient sync, once per step."
)


def stages_tables(plan: Plan, width: int | None = None) -> list[Table]:
    """The stages as one table when the output is wide, as two (layout; time and memory) when narrow."""
    layout, cost = _stage_layout_rows(plan), _stage_cost_rows(plan)
    if output_width(width) >= ONE_TABLE_WIDTH:
        rows = [a + b for a, b in zip(layout, cost)]
        return [table("Stages", _LAYOUT + _COST, rows, caption=_STAGES_CAPTION)]
    rows = [[a[0], *b] for a, b in zip(layout, cost)]
    return [
        table("Stages: layout", _LAYOUT, layout),
        table("Stages: predicted time and memory", ["stage", *_COST], rows, caption=_STAGES_CAPTION),
    ]


def breakdown_table(plan: Plan) -> Table:
    p = plan.predicted
    total = float(p.get("step_time_s") or 0) or 1.0
    rows = [
        [k[:-2], time_s(p[k]), pct(float(p[k]) / total)] for k in ("compute_s", "communication_s", "bubble_s") if k in p
    ]
    return table("Time breakdown per step (critical path)", ["part", "time per step", "share of step"], rows)


def alternatives_table(plan: Plan) -> Table:
    rows = [
        [str(a.get("summary", "")), time_s(a.get("step_time_s")), str(a.get("why", ""))]
        for a in plan.search.get("alternatives", [])
    ]
    caption = (
        "dp = data-parallel replicas, b = micro-batch size, m = micro-batches per step; each [...] is a stage: "
        "layer units, device type, dp x tp, ZeRO stage (z), recompute."
        if rows
        else "a hand-made layout (partita compile --tp/--pp/--dp): nothing was searched."
        if "hand_layout" in plan.search
        else "the search recorded no alternatives."
    )
    return table(
        "Top alternatives and why they lost", ["alternative", "step time", "why it lost"], rows, caption=caption
    )


def hand_layout_table(plan: Plan) -> Table | None:
    """The chosen plan against the best Megatron-style hand layout over every device of the cluster's
    first type (``search/entry/hand_best.py``: tp within a node x pp x dp, ZeRO and recompute chosen)."""
    h = plan.search.get("best_hand_layout")
    if not h:
        return None
    step, used = plan.predicted.get("step_time_s"), sum(used_devices(plan).values())
    total = sum(cluster_devices(plan).values()) or plan.world_size
    mem = max((float(s.predicted.get("memory_bytes", 0)) for s in plan.stages), default=0.0)
    pp = len(plan.stages)
    chosen = "; ".join(
        f"dp {s.dp} x tp {s.tp} {s.device_type}, ZeRO-{s.zero_stage}, recompute {s.recompute}" for s in plan.stages
    )
    chosen = f"pp {pp}: {chosen}" if pp > 1 else chosen
    hand = (
        f"tp {h['tp']} x pp {h['pp']} x dp {h['dp']} {h['device']}, micro-batch {h['micro_batch']}, "
        f"ZeRO-{h['zero_stage']}, recompute {h['recompute']}"
    )
    rows = [
        ["chosen plan", chosen, time_s(step), gib(mem), f"{used} of {total}"],
        [
            "best hand layout" + ("" if h["fits"] else " (does not fit)"),
            hand,
            time_s(h["step_time_s"]),
            gib(h["memory_bytes"]),
            f"{h['devices_used']} of {total}",
        ],
    ]
    ratio = float(h["step_time_s"]) / float(step) if step else 0.0
    best = (
        f"the best of {plural(int(h.get('num_priced', 0)), 'hand layout')} over all {h['devices_used']} {h['device']}"
    )
    if not h["fits"]:
        why = (
            f"no hand layout over all {h['devices_used']} {h['device']} fits memory (the closest needs "
            f"{gib(h['memory_bytes'])} of {gib(h['memory_capacity'])} per device)"
        )
    elif ratio < 0.995:
        why = f"{best} is {1 / ratio:.2f}x as fast as the chosen plan (the search does not reach it)"
    elif ratio < 1.005:
        why = f"{best} takes the same predicted step time (within 0.5%)"
    else:
        why = f"{best} takes {ratio:.2f}x the chosen plan's step time"
    have, busy = cluster_devices(plan).get(h["device"], h["devices_used"]), used_devices(plan).get(h["device"], 0)
    if busy < have:
        why = (
            f"the chosen plan leaves {have - busy} of {have} {h['device']} idle because using them does not pay: {why}"
        )
    others = {k: v for k, v in (plan.predicted.get("idle_reasons") or {}).items() if k != h["device"]}
    why += "".join(
        f"; {k}: {v}" for k, v in others.items()
    )  # idle devices of other types (search/pricing/precision.py)
    return table(
        "Against the best hand layout (every device of one type)",
        ["plan", "layout", "step time", "memory / device", "devices"],
        rows,
        caption=why + ".",
    )


def _chosen_step(plan: Plan, per_schedule: dict) -> float:
    """The chosen plan's step among ``plan.search["schedules"]`` (key ``zbv v2`` with chunks)."""
    key = plan.schedule + (f" v{plan.num_virtual_stages}" if plan.num_virtual_stages > 1 else "")
    return float(per_schedule.get(key, min(per_schedule.values(), default=0.0)))


def schedule_losses(plan: Plan) -> str:
    """``"; others: zb_h1 +4.1%, 1f1b +5.0%"``: by how much each other schedule family searched loses
    against the chosen plan (issue 19; ``schedule_cost.best_per_schedule``), "" when none was."""
    got = plan.search.get("schedules") if isinstance(plan.search, dict) else None
    if not isinstance(got, dict) or len(got) < 2:
        return ""
    best = _chosen_step(plan, got)
    key = plan.schedule + (f" v{plan.num_virtual_stages}" if plan.num_virtual_stages > 1 else "")
    rest = [f"{s} {t / best - 1:+.1%}" for s, t in got.items() if s != key and best > 0]
    return "; others: " + ", ".join(rest) if rest else ""


def search_table(plan: Plan) -> Table:
    rows = []
    for k in sorted(plan.search):
        if k in ("alternatives", "best_hand_layout"):  # their own tables
            continue
        v = plan.search[k]
        if k == "schedules" and isinstance(v, dict):  # each schedule's best step: by how much the others lose
            best = _chosen_step(plan, v)
            v = "; ".join(
                f"{s} {time_s(t)}" + (f" (+{t / best - 1:.1%})" if 0 < best < t else "") for s, t in v.items()
            )
        if isinstance(v, (list, dict)):
            v = json.dumps(v, sort_keys=True, separators=(", ", ": "))[:200]
        rows.append([k.replace("_", " "), str(v)])
    return table("Search statistics", ["what", "value"], rows or [["statistics", "none recorded"]], show_header=False)


def plan_tables(plan: Plan, width: int | None = None) -> list[Table]:
    return [
        summary_table(plan),
        *stages_tables(plan, width),
        breakdown_table(plan),
        alternatives_table(plan),
        *[t for t in (hand_layout_table(plan),) if t is not None],
        search_table(plan),
    ]


def plan_text(plan: Plan, run_log: Mapping[str, Any] | None = None, width: int | None = None) -> str:
    """The plan's tables; with a run log, its "Predicted vs measured" tables after them."""
    tables = plan_tables(plan, width)
    if run_log:
        tables += run_log_tables(run_log)
    return render(*tables, width=width)


def compare_text(a: Plan, b: Plan, width: int | None = None) -> str:
    def meshes(p: Plan) -> str:
        return " | ".join(f"{s.device_type} {s.dp}x{s.tp}" for s in p.stages)

    rows: list[list[Any]] = [
        ["model", a.model.get("name"), b.model.get("name")],
        ["cluster", f"{a.cluster.get('name')} ({devices_phrase(a)})", f"{b.cluster.get('name')} ({devices_phrase(b)})"],
        ["step time", time_s(a.predicted.get("step_time_s")), time_s(b.predicted.get("step_time_s"))],
        ["tokens / s", f"{a.predicted.get('tokens_per_s', 0):,.0f}", f"{b.predicted.get('tokens_per_s', 0):,.0f}"],
        ["stages", str(a.num_stages), str(b.num_stages)],
        [
            "schedule",
            f"{a.schedule}, {plural(a.num_micro_batches, 'micro-batch', 'micro-batches')}",
            f"{b.schedule}, {plural(b.num_micro_batches, 'micro-batch', 'micro-batches')}",
        ],
        ["meshes (dp x tp)", meshes(a), meshes(b)],
    ]
    text = render(table("Plan comparison", ["", "A", "B"], [[str(x) for x in r] for r in rows]), width=width)
    ta, tb = a.predicted.get("step_time_s"), b.predicted.get("step_time_s")
    if ta and tb:
        faster, ratio = ("A", tb / ta) if ta <= tb else ("B", ta / tb)
        by = f"{ratio:.1f}x as fast" if ratio >= 2 else f"faster by {100 * (ratio - 1):.1f}%"
        text += f"{faster} is {by} per step\n"
    return text


# ---- `partita evaluate` and `partita trace` ----------------------------------------------------
def evaluate_text(ev: Mapping[str, Any], width: int | None = None) -> str:
    """A fixed configuration's prediction (``search.evaluate.Evaluation.to_dict()``), readable:
    times per step or per micro-batch, memory in GiB per device against capacity, by category."""
    cap = ev.get("memory_capacity")
    fits = "fits in memory" if ev.get("fits") else "DOES NOT FIT in memory"
    lay = dict(ev.get("layout") or {})
    rows = [["predicted step time", f"{time_s(ev.get('predicted_step_time_s'))} per step ({fits})"]]
    if lay:
        used, total = lay.get("devices_used"), lay.get("devices_total")
        rows.append(
            [
                "layout",
                f"dp {lay.get('dp')} x tp {lay.get('tp')} x pp {lay.get('pp')} on "
                + (f"{used} of {plural(int(total), 'device')}" if used and total else "the cluster")
                + f" ({lay.get('device')}); {plural(int(lay.get('num_micro_batches') or 0), 'micro-batch', 'micro-batches')}"
                f" of {lay.get('micro_batch')} per replica, {lay.get('schedule')}, ZeRO-{lay.get('zero_stage')}, "
                f"recompute {lay.get('recompute')}",
            ]
        )
        for k in ("calibration", "network"):
            if lay.get(k):
                rows.append([k, str(lay[k])])
    rows += [
        ["tokens / s", f"{float(ev.get('tokens_per_s') or 0):,.0f}"],
        ["pipeline", f"{time_s(ev.get('pipeline_s'))} per step, of which bubble {time_s(ev.get('bubble_s'))}"],
        ["grad sync at step end", f"{time_s(ev.get('tail_s'))} per step"],
    ]
    if ev.get("mfu"):
        rows.append(["MFU (vs peak of the devices used)", pct(ev.get("mfu"))])
    if ev.get("mfu_cluster"):
        rows.append(["MFU (vs peak of the whole cluster)", pct(ev.get("mfu_cluster"))])
    for note in ev.get("notes") or ():
        rows.append(["note", str(note)])
    times = list(ev.get("stage_times_s") or [])
    mems = list(ev.get("memory_per_device") or [])
    cats = list(ev.get("memory_by_category") or [])
    stage_rows = []
    for i in range(max(len(times), len(mems))):
        mem = float(mems[i]) if i < len(mems) else None
        used_of = gib(mem) + (f" of {gib(cap)}" if cap else "")
        row = [
            str(i),
            time_s(times[i]) if i < len(times) else "-",
            used_of if mem is not None else "-",
            ("yes" if mem <= float(cap) else "NO") if cap and mem is not None else "-",
        ]
        if cats:
            c = cats[i] if i < len(cats) else {}
            row.append(", ".join(f"{k.replace('_', ' ')} {gib(v)}" for k, v in c.items() if float(v)) or "-")
        stage_rows.append(row)
    header = ["stage", "time per micro-batch", "memory per device", "fits"]
    if cats:
        header.append("memory by category (per device)")
    return render(
        table("Evaluated configuration", ["what", "value"], rows, show_header=False),
        table("Per stage", header, stage_rows),
        width=width,
    )


def trace_text(summary: Mapping[str, Any], labels: Mapping[str, str], width: int | None = None) -> str:
    """``partita trace``: the model's size and one row per layer, kinds named by what they contain
    (``labels``: kind hash -> readable description, see ``report.trace_kinds``)."""
    s = summary
    head = (
        f"{s['model']} ({s['framework']}): {s['num_nodes']:,} nodes, {s['num_params']:,} params "
        f"({s['param_bytes'] / 1e9:.2f} GB), forward {s['forward_flops'] / 1e12:.3f} TFLOP at batch "
        f"{s['batch']}, seq {s['seq']}; traced in {s['trace_time_s']:.1f} s"
    )
    rows = [
        [
            lay["name"],
            labels.get(lay["kind"], lay["kind"]),
            f"{lay['num_nodes']:,}",
            f"{lay['num_params']:,}",
            f"{lay['forward_flops'] / 1e9:,.2f}",
            f"{lay['activation_bytes'] / 2**20:,.1f}",
        ]
        for lay in s["layers"]
    ]
    layers = table(
        f"{plural(s['num_layers'], 'layer')} (pipeline units)",
        ["layer", "kind", "nodes", "params", "forward GFLOP", "activations MiB"],
        rows,
    )
    rep = [
        [
            str(r["count"]),
            labels.get(r["kind"], r["kind"]),
            f"{r['layers'][0]} .. {r['layers'][-1]}",
        ]
        for r in s["repeated_layers"]
    ]
    tables: list[Table] = [layers]
    if rep:
        tables.append(table("Repeated layers (solved once per kind)", ["count", "kind", "layers"], rep))
    return head + "\n" + render(*tables, width=width)
