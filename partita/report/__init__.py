"""Reports: what the plan chose and why, as terminal tables (``terminal.py``), one self-contained
HTML page (``html.py``), and predicted vs measured per run (``run_log.py``, shown by
``run_log_view.py``).

Top of the flow, beside the driver: called by the CLI (``partita report``) and the driver; reads
only Plans and run logs, never the search or the runtimes (``trace_kinds.py`` reads a traced graph
for ``partita trace``).
"""

from partita.report.html import compare_html, plan_html, run_log_html
from partita.report.run_log_view import run_log_tables, run_log_text
from partita.report.terminal import (
    alternatives_table,
    breakdown_table,
    compare_text,
    evaluate_text,
    plan_text,
    search_table,
    stages_tables,
    summary_table,
    trace_text,
)

__all__ = [
    "alternatives_table",
    "breakdown_table",
    "compare_html",
    "compare_text",
    "evaluate_text",
    "plan_html",
    "plan_text",
    "run_log_html",
    "run_log_tables",
    "run_log_text",
    "search_table",
    "stages_tables",
    "summary_table",
    "trace_text",
]
