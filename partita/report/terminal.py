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

from rich.markup import escape as markup_escape
from rich.table import Table

from partita.plan import Plan
from partita.report.fmt import (
    cluster_devices,
    counts_text,
    devices_phrase,
    gib,
    output_width,
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
from partita.report.run_log_view import run_log_tables
from partita.report.tables import render, table
from partita.search.pipeline.schedule import splits_backward

ONE_TABLE_WIDTH = 150  # at least this wide: the stages fit one table; narrower: two


# ---- a plan ------------------------------------------------------------------------------------
def summary_table(plan: Plan) -> Table:
    p, tr = plan.predicted, plan.training
    rows = [
        ["predicted step time", f"{time_s(p.get('step_time_s'))} per step"],
        ["tokens / s", f"{tokens_per_s(plan):,.0f}"],
        ["MFU (vs peak of the devices used)", pct(p.get("mfu"))],
        [
            "global batch x seq",
            f"{tr.get('global_batch')} x {tr.get('seq_len')} ({tr.get('dtype')}, {tr.get('optimizer')})",
        ],
        [
            "schedule",
            f"{plan.schedule}, {plural(plan.num_micro_batches, 'micro-batch', 'micro-batches')} of "
            f"{plural(plan.micro_batch_size, 'sample')} per replica" + _shares_note(plan) + ", "
            f"{stage_count_phrase(plan)}"
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
    rows += [[what, markup_escape(why)] for what, why in choice_notes(plan)]  # "partita[fp8]" is not a style
    headroom = []
    for s in plan.stages:
        for dev, mem, cap in stage_memory(plan, s):
            if cap and mem:
                headroom.append(f"stage {s.index} ({dev}): {gib(cap - mem)}")
    rows.append(["memory headroom per device (of usable)", ", ".join(headroom) or "-"])
    name = f"Plan for {plan.model.get('name')} on {plan.cluster.get('name')} ({devices_phrase(plan)})"
    return table(name, ["what", "value"], rows, show_header=False)


def choice_notes(plan: Plan) -> list[tuple[str, str]]:
    """Why the search chose context parallelism and FP8 or not (issue 36, ``search/entry/choices.py``'s
    records): ``(what, why)`` per choice the plan records; none where nothing was offered or asked."""
    out = []
    cp = plan.search.get("context_parallel")
    if isinstance(cp, Mapping) and cp.get("why"):
        out.append(("context parallelism", str(cp["why"])))
    f8 = plan.search.get("fp8")
    if isinstance(f8, Mapping) and f8.get("why"):
        per_type = f8.get("types") if f8.get("chosen") else None  # each type's precision in the plan (Stage.fp8)
        kept = "; ".join(f"{k}: {v}" for k, v in sorted((per_type or f8.get("bf16_types") or {}).items()))
        out.append(("fp8", str(f8["why"]) + (f"; {kept}" if kept else "")))
    return out


def _shares_note(plan: Plan) -> str:
    """`` (split 3:1 over the replicas of stage 1)``: where a stage splits each micro-batch unevenly
    over its replicas, the summary says so beside "of N samples per replica" (the per-replica size is
    the mean; the split is what each replica runs)."""
    uneven = [s for s in plan.stages if s.batch_shares and len(set(s.batch_shares)) > 1]
    if not uneven:
        return ""
    s = uneven[0]
    more = f" and {len(uneven) - 1} more" if len(uneven) > 1 else ""
    return (
        f" on average (stage {s.index}{more} splits each micro-batch {':'.join(map(str, s.batch_shares))} "
        "over its replicas)"
    )


def rank_group(plan: Plan, stage_index: int) -> int:
    """The rank group (pipeline position) running stage ``stage_index``."""
    for r, group in enumerate(plan.positions()):
        if any(s.index == stage_index for s in group):
            return r
    return stage_index


def _stage_layers(layers: Sequence[str]) -> str:
    return layers[0] if len(layers) == 1 else f"{layers[0]} .. {layers[-1]} ({len(layers)} layers)"


def _stage_layout_rows(plan: Plan) -> list[list[str]]:
    rows = []
    for s in plan.stages:
        ranks = f"{s.ranks[0]}-{s.ranks[-1]}" if len(s.ranks) > 1 else str(s.ranks[0])
        rows.append(
            [
                str(s.index) + (f" (group {rank_group(plan, s.index)})" if plan.chunked else ""),
                _stage_layers(s.layers),
                s.device_type,
                ranks,
                f"{s.dp} x {s.tp}"
                + (f", cp {s.cp}" if s.cp > 1 else "")  # context parallelism: dp x cp x tp ranks
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
    keys = ("compute_s", "comm_s", "tail_s")
    unit = time_unit(s.predicted.get(k) for s in plan.stages for k in keys)
    for s in plan.stages:
        mems = []
        per_type = stage_memory(plan, s)
        for dev, mem, cap in per_type:
            short = mem is not None and cap is not None and mem >= 0.01 * 2**30
            text = f"{mem / 2**30:.2f} of {gib(cap)}" if short else gib(mem) + (f" of {gib(cap)}" if cap else "")
            mems.append(f"{text} ({dev})" if len(per_type) > 1 else text)
        rows.append([*(time_in(s.predicted.get(k), unit) for k in keys), "\n".join(mems)])
    return rows


_LAYOUT = ["stage", "layers", "device", "ranks", "dp x tp", "ZeRO", "recompute", "batch shares"]
_COST = ["compute per micro-batch", "comm per micro-batch", "grad sync at step end", "memory per device (usable)"]
_STAGES_CAPTION = (
    "per micro-batch: one forward + backward of one micro-batch on the stage; grad sync at step end: the "
    "exposed part of the gradient sync, once per step; memory: predicted peak per device of the usable "
    "capacity the search held it under, per device type where a stage spans several."
)


def _stages_caption(plan: Plan) -> str:
    if not plan.chunked:
        return _STAGES_CAPTION
    return _STAGES_CAPTION + (
        f" A stage is a contiguous range of layers (a virtual stage, or model chunk); each of the "
        f"{plural(plan.num_positions, 'rank group')} runs {plan.num_stages // max(1, plan.num_positions)} "
        f"stages ({plan.schedule})."
    )


def stages_tables(plan: Plan, width: int | None = None) -> list[Table]:
    """The stages as one table when the output is wide, as two (layout; time and memory) when narrow."""
    layout, cost = _stage_layout_rows(plan), _stage_cost_rows(plan)
    if output_width(width) >= ONE_TABLE_WIDTH:
        rows = [a + b for a, b in zip(layout, cost)]
        return [table("Stages", _LAYOUT + _COST, rows, caption=_stages_caption(plan))]
    rows = [[a[0], *b] for a, b in zip(layout, cost)]
    return [
        table("Stages: layout", _LAYOUT, layout),
        table("Stages: predicted time and memory", ["stage", *_COST], rows, caption=_stages_caption(plan)),
    ]


def breakdown_table(plan: Plan) -> Table:
    p = plan.predicted
    total = float(p.get("step_time_s") or 0) or 1.0
    keys = [k for k in ("compute_s", "communication_s", "bubble_s") if k in p]
    unit = time_unit([p.get("step_time_s"), *(p[k] for k in keys)])
    rows = [[k[:-2], time_in(p[k], unit), pct(float(p[k]) / total)] for k in keys]
    busy = utilization_text(plan)
    caption = (
        "critical path: the busiest stage; bubble is the time it waits. Off that path a rank group waits "
        "longer; the share of the step each works on its stages (the rest: waiting, gradient sync): "
        + (busy + "." if busy else "not recorded (the page's pipeline chart shows it).")
        if plan.num_positions > 1
        else ""
    )
    return table(
        "Time breakdown per step (critical path)", ["part", "time per step", "share of step"], rows, caption=caption
    )


def _alternative_why(a: Mapping[str, Any], chosen: float | None) -> str:
    """Why an alternative lost, in ms: the gap and each part that moved, with signs, plus whatever the
    parts leave of the gap (so they sum to it); the plan's own text when it records no parts."""
    parts, step = a.get("parts_s"), a.get("step_time_s")
    if not isinstance(parts, Mapping) or step is None or not chosen:
        return str(a.get("why", ""))
    gap = float(step) - float(chosen)
    moved = {k: float(v) for k, v in parts.items() if abs(float(v)) >= 5e-5}
    rest = gap - sum(float(v) for v in parts.values())
    if abs(rest) >= 5e-5:
        moved["other"] = rest
    body = ", ".join(
        f"{k} {time_in(v, 'ms', signed=True)}" for k, v in sorted(moved.items(), key=lambda kv: -abs(kv[1]))
    )
    return f"{time_in(gap, 'ms', signed=True)} ({gap / float(chosen):+.1%}): " + (body or "no part moved")


def alternatives_table(plan: Plan) -> Table:
    chosen = plan.predicted.get("step_time_s")
    rows = [
        [str(a.get("summary", "")), time_in(a.get("step_time_s"), "ms"), _alternative_why(a, chosen)]
        for a in plan.search.get("alternatives", [])
    ]
    units = plan.search.get("layer_units")
    layers = len(plan.model.get("layers") or ())
    unit_note = (
        f" A layer unit (u) is a run of consecutive layers the search places as one: it grouped the "
        f"{plural(layers, 'layer')} into {units} units."
        if units and layers and int(units) != layers
        else " A layer unit (u) is one layer."
    )
    caption = (
        "dp = data-parallel replicas, b = micro-batch size, m = micro-batches per step, v = stages per rank "
        "group; each [...] is a rank group: the layer units it holds, device type, dp x tp, ZeRO stage (z), "
        "recompute." + unit_note + " Step time and the gap "
        "per step in ms; the gap is the sum of the parts (compute, communication, bubble on the critical path)."
        if rows
        else "a hand-made layout (partita compile --tp/--pp/--dp): nothing was searched."
        if "hand_layout" in plan.search
        else "the search recorded no alternatives."
    )
    return table(
        "Top alternatives and why they lost",
        ["alternative", "step time", "slower by, and where"],
        rows,
        caption=caption,
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
    pp = plan.num_positions
    chosen = "; ".join(
        f"dp {g[0].dp} x tp {g[0].tp} {g[0].device_type}, ZeRO-{g[0].zero_stage}, recompute {g[0].recompute}"
        for g in plan.positions()
    )
    if pp > 1:
        chosen = f"pp {pp}" + (f" ({plan.num_stages // pp} stages each)" if plan.chunked else "") + f": {chosen}"
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
    others = {k: v for k, v in sorted((plan.predicted.get("idle_reasons") or {}).items()) if k != h["device"]}
    why += "".join(
        f"; {k}: {v}" for k, v in others.items()
    )  # idle devices of other types (search/pricing/precision.py)
    return table(
        "Against the best hand layout (every device of one type)",
        ["plan", "layout", "step time", "memory / device", "devices"],
        rows,
        caption=why + ".",
    )


def _chosen_key(plan: Plan) -> str:
    return plan.schedule + (f" v{plan.num_virtual_stages}" if plan.num_virtual_stages > 1 else "")


def _schedules(plan: Plan) -> list[tuple[str, float]]:
    """Each schedule family's best step, fastest first (ties by name): the same order whatever order
    plan.json keeps its keys in, so ``report`` prints what ``compile`` printed."""
    got = plan.search.get("schedules") if isinstance(plan.search, dict) else None
    if not isinstance(got, dict):
        return []
    return sorted(((str(k), float(v)) for k, v in got.items()), key=lambda kv: (kv[1], kv[0]))


def _chosen_step(plan: Plan, per_schedule: list[tuple[str, float]]) -> float:
    """The chosen plan's step among the schedules searched (key ``zbv v2`` with chunks)."""
    return dict(per_schedule).get(_chosen_key(plan), min((t for _, t in per_schedule), default=0.0))


def schedule_losses(plan: Plan) -> str:
    """``"; others: zb_h1 +4.1%, 1f1b +5.0%"``: by how much each other schedule family searched loses
    against the chosen plan (issue 19), fastest first; "" when none was."""
    got = _schedules(plan)
    if len(got) < 2:
        return ""
    best, key = _chosen_step(plan, got), _chosen_key(plan)
    rest = [f"{s} {t / best - 1:+.1%}" for s, t in got if s != key and best > 0]
    return "; others: " + ", ".join(rest) if rest else ""


SCHEDULE_NAMES = {  # what each schedule family does, said once per report (issue 35)
    "gpipe": "every micro-batch's forward, then every backward",
    "1f1b": "one forward, one backward, alternating (Megatron's 1F1B)",
    "interleaved_1f1b": "1F1B with v stages per rank group, placed in a loop (Megatron's interleaved)",
    "zb_h1": "zero-bubble H1: 1F1B whose backward is split into input gradient (B) and weight gradients (W), "
    "the W's deferred into the bubble",
    "zbv": "zero-bubble V: 2 stages per rank group placed in a V (the first and the last on group 0), "
    "backward split into B and W as zb_h1",
}


def schedules_table(plan: Plan) -> Table | None:
    """Each schedule family the search priced, fastest first, with what it is and its loss."""
    got = _schedules(plan)
    if not got:
        return None
    best, key = _chosen_step(plan, got), _chosen_key(plan)
    unit = time_unit(t for _, t in got)
    rows, said = [], set()
    for name, t in got:
        family = name.split(" ")[0]
        what = SCHEDULE_NAMES.get(family, "") if family not in said else "(as above)"
        said.add(family)
        rows.append(
            [
                name + (" (chosen)" if name == key else ""),
                time_in(t, unit),
                "-" if name == key or not best else f"{t / best - 1:+.1%}",
                what,
            ]
        )
    return table(
        "Schedules searched (best step of each, fastest first)",
        ["schedule", "step time", "vs chosen", "what it is"],
        rows,
        caption="vN: N stages (model chunks) per rank group.",
    )


USER_STATS = {  # the search statistics a user reads; the rest are developer counters (--verbose)
    "num_candidates": "stage candidates priced",
    "num_configs": "configurations (dp x micro-batch) searched",
    "num_plans_compared": "whole plans compared",
    "layer_units": "layer units (runs of consecutive layers placed as one)",
    "time_s": "search time",
}


def search_table(plan: Plan, verbose: bool = False) -> Table:
    """What the search did, in words; with ``verbose`` (``--verbose``) every recorded counter too,
    the developer ones (rule counters R1/R2/R7, the ILP memo) and raw structures included."""
    rows = []
    for k, label in USER_STATS.items():
        if k in plan.search:
            v = plan.search[k]
            rows.append([label, time_s(v) if k == "time_s" else f"{v:,}" if isinstance(v, int) else str(v)])
    if verbose:
        for k in sorted(plan.search):
            if k in USER_STATS or k in ("alternatives", "best_hand_layout", "schedules"):  # shown elsewhere
                continue
            v = plan.search[k]
            if isinstance(v, (list, dict)):
                v = json.dumps(v, sort_keys=True, separators=(", ", ": "))[:200]
            rows.append([k.replace("_", " "), str(v)])
    hidden = [
        k for k in plan.search if k not in USER_STATS and k not in ("alternatives", "best_hand_layout", "schedules")
    ]
    caption = "" if verbose or not hidden else f"{plural(len(hidden), 'developer counter')} more with --verbose."
    return table(
        "Search statistics",
        ["what", "value"],
        rows or [["statistics", "none recorded"]],
        show_header=False,
        caption=caption,
    )


_MEMORY_CAPTION = (
    "per device: the tensors the search prices (parameters, gradients, optimizer state, activations) and what "
    "the process holds beside them (partita/device_reserve.py: CUDA context, NCCL buffers of the process "
    "groups the stage's records name, allocator margin on the tensors); host: a rank's peak while its stage "
    "is set up (process base + the largest parameter in f32 + its shard, one parameter at a time)."
)


def memory_table(plan: Plan) -> Table | None:
    """Per stage and device type: the predicted tensors, the items beyond them and the device total
    (``Stage.predicted["memory_beyond_tensors"]``), and the host peak (``predicted["host_memory"]``)."""
    rows = []
    for s in plan.stages:
        beyond = s.predicted.get("memory_beyond_tensors") or {}
        host = (s.predicted.get("host_memory") or {}).get("bytes")
        for dev, it in beyond.items():
            rows.append(
                [
                    str(s.index),
                    dev,
                    gib(s.predicted.get("memory_bytes")),
                    gib(it["cuda_context"]),
                    f"{gib(it['nccl_buffers'])} ({int(it['nccl_communicators'])})",
                    gib(it["allocator_margin"]),
                    gib(it["total"]),
                    gib(host) if host else "-",
                ]
            )
    if not rows:
        return None
    header = ["stage", "device", "tensors", "CUDA context", "NCCL (groups)", "allocator", "device total", "host peak"]
    return table("Memory per device beyond tensors", header, rows, caption=_MEMORY_CAPTION)


def plan_tables(plan: Plan, width: int | None = None, verbose: bool = False) -> list[Table]:
    return [
        summary_table(plan),
        *stages_tables(plan, width),
        *[t for t in (memory_table(plan),) if t is not None],
        breakdown_table(plan),
        alternatives_table(plan),
        *[t for t in (hand_layout_table(plan), schedules_table(plan)) if t is not None],
        search_table(plan, verbose),
    ]


def plan_text(
    plan: Plan, run_log: Mapping[str, Any] | None = None, width: int | None = None, verbose: bool = False
) -> str:
    """The plan's tables; with a run log, its "Predicted vs measured" tables after them."""
    tables = plan_tables(plan, width, verbose)
    if run_log:
        tables += run_log_tables(run_log)
    return render(*tables, width=width)


def tokens_per_s(plan: Plan) -> float:
    """Predicted tokens per second: the plan's record, else global batch x seq over the step time."""
    got = plan.predicted.get("tokens_per_s")
    if got:
        return float(got)
    step, tr = plan.predicted.get("step_time_s"), plan.training
    if not step:
        return 0.0
    return float(tr.get("global_batch") or 0) * float(tr.get("seq_len") or 0) / float(step)


def sample_time_s(plan: Plan) -> float | None:
    """Predicted time per sample (step time over the global batch): comparable across batch sizes."""
    step, batch = plan.predicted.get("step_time_s"), plan.training.get("global_batch")
    return float(step) / float(batch) if step and batch else None


def compare_verdict(a: Plan, b: Plan) -> str:
    """Which plan trains faster, drawn from throughput (tokens/s), never from the step time alone: two
    plans of different global batches do different work per step (issue 35)."""
    ta, tb = tokens_per_s(a), tokens_per_s(b)
    if not (ta and tb):
        return ""
    faster, ratio = ("A", ta / tb) if ta >= tb else ("B", tb / ta)
    by = f"{ratio:.1f}x the throughput of" if ratio >= 2 else f"{100 * (ratio - 1):.1f}% more throughput than"
    slower = "B" if faster == "A" else "A"
    text = f"{faster} has {by} {slower} ({max(ta, tb):,.0f} vs {min(ta, tb):,.0f} tokens/s)"
    ba, bb = a.training.get("global_batch"), b.training.get("global_batch")
    sa, sb = a.training.get("seq_len"), b.training.get("seq_len")
    if (ba, sa) != (bb, sb):
        text += (
            f"; their steps differ in work (batch {ba} x {sa} vs {bb} x {sb}), so compare tokens/s or time per "
            "sample, not step time"
        )
    return text + "\n"


def compare_text(a: Plan, b: Plan, width: int | None = None) -> str:
    def meshes(p: Plan) -> str:
        return " | ".join(f"{s.device_type} {s.dp}x{s.tp}" for s in p.stages)

    def per_sample(p: Plan) -> str:
        t = sample_time_s(p)
        return f"{time_s(t)} per sample" if t is not None else "-"

    rows: list[list[Any]] = [
        ["model", a.model.get("name"), b.model.get("name")],
        ["cluster", f"{a.cluster.get('name')} ({devices_phrase(a)})", f"{b.cluster.get('name')} ({devices_phrase(b)})"],
        ["global batch x seq", *(f"{p.training.get('global_batch')} x {p.training.get('seq_len')}" for p in (a, b))],
        ["tokens / s", f"{tokens_per_s(a):,.0f}", f"{tokens_per_s(b):,.0f}"],
        ["time per sample", per_sample(a), per_sample(b)],
        ["step time", *(f"{time_s(p.predicted.get('step_time_s'))} per step" for p in (a, b))],
        ["stages", stage_count_phrase(a), stage_count_phrase(b)],
        [
            "schedule",
            f"{a.schedule}, {plural(a.num_micro_batches, 'micro-batch', 'micro-batches')}",
            f"{b.schedule}, {plural(b.num_micro_batches, 'micro-batch', 'micro-batches')}",
        ],
        ["meshes (dp x tp)", meshes(a), meshes(b)],
    ]
    text = render(table("Plan comparison", ["", "A", "B"], [[str(x) for x in r] for r in rows]), width=width)
    return text + compare_verdict(a, b)


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
                f"dp {lay.get('dp')} x "
                + (f"cp {lay.get('cp')} x " if (lay.get("cp") or 1) > 1 else "")  # context parallelism
                + f"tp {lay.get('tp')} x pp {lay.get('pp')} on "
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
