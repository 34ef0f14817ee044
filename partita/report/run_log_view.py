"""Terminal view of a run log (``DIR/run_log.json``): predicted vs measured step time, losses and
collectives per stage, with the likely causes of a large step-time gap and what fixes them.

Part of ``report/``; reads only the run log (``run_log.py`` writes it), renders with the terminal
view's table helper so it wraps like the plan's tables.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rich.table import Table

from partita.report.fmt import nbytes, pct, time_s
from partita.report.run_log import GAP_THRESHOLD, gap_causes, mismatch
from partita.report.tables import render, table


def count(e: Mapping[str, Any] | None) -> str:
    return "-" if not e else str(int(e.get("count") or 0))


def coll_bytes(e: Mapping[str, Any] | None) -> str:
    """Bytes per step of one collective kind; ``-`` when unknown or when no call was predicted."""
    if not e or not int(e.get("count") or 0):
        return "-"
    return nbytes(e.get("bytes"))


def collective_rows(log: Mapping[str, Any]) -> list[list[str]]:
    rows = []
    for s in log.get("stages", []):
        measured = bool(s.get("collectives_measured"))
        for kind, row in s.get("collectives", {}).items():
            pred, meas = row.get("predicted"), row.get("measured")
            mc = (count(meas) if meas else "0") if measured else "-"
            same = "-" if not measured else "NO" if mismatch(kind, pred, meas) else "yes"
            rows.append([str(s["index"]), kind, count(pred), mc, coll_bytes(pred), coll_bytes(meas), same])
    return rows


def run_log_tables(log: Mapping[str, Any]) -> list[Table]:
    """ "Predicted vs measured" from a run log (``DIR/run_log.json``, written by ``partita run DIR``)."""
    st = log.get("step_time_s") or {}
    measured = st.get("measured") or []
    how = f" (median of {len(measured)})" if measured else " (not measured)"
    rows = [["step time (per step)", time_s(st.get("predicted")), time_s(st.get("measured_median")) + how,
             pct(st.get("error"), signed=True)]]  # fmt: skip
    for s in log.get("stages", []):
        m, p = s.get("measured_time_s"), s.get("predicted_time_s")
        err = (m - p) / p if m and p else None
        rows.append([f"stage {s['index']} time (per micro-batch)", time_s(p), time_s(m), pct(err, signed=True)])
    losses, ref = log.get("losses") or [], log.get("reference_losses")
    if losses:
        diff = max(abs(a - b) for a, b in zip(losses, ref)) if ref else None
        rows.append(
            [
                "losses (first -> last step)",
                f"reference {ref[0]:.4f} -> {ref[-1]:.4f}" if ref else "-",
                f"{losses[0]:.4f} -> {losses[-1]:.4f}",
                f"max |diff| {diff:.1e}" if diff is not None else "-",
            ]
        )
    title = f"Predicted vs measured ({log.get('framework')} run, {log.get('steps')} steps)"
    tables = [table(title, ["what", "predicted", "measured", "error"], rows)]
    causes = gap_causes(log)
    if causes:
        tables.append(
            table(
                f"Why the step time is off by {pct(st.get('error'), signed=True)} (more than "
                f"{100 * GAP_THRESHOLD:.0f}%): likely causes",
                ["likely cause", "fix"],
                [list(c) for c in causes],
            )
        )
    src = "in the compiled HLO" if log.get("collective_source") == "hlo" else "at run time, first rank per stage"
    tables.append(
        table(
            f"Collectives per step, predicted vs measured (counted {src})",
            ["stage", "kind", "predicted #", "measured #", "predicted bytes", "measured bytes", "match"],
            collective_rows(log),
            caption="bytes: per step, all calls of the kind together; - = not known or no call.",
        )
    )
    gaps = [[str(g)] for g in log.get("gaps", [])]
    if gaps:
        tables.append(table("Not measured by this run", ["gap"], gaps, show_header=False))
    return tables


def run_log_text(log: Mapping[str, Any], width: int | None = None) -> str:
    return render(*run_log_tables(log), width=width)
