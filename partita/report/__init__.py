"""Reports: what the plan chose and why, as terminal tables (``terminal.py``), one self-contained
HTML page (``html.py``), and predicted vs measured per run (``run_log.py``).

Top of the flow, beside the driver: called by the CLI (``partita report``) and the driver; reads
only Plans and run logs, never the search or the runtimes.
"""

from partita.report.html import plan_html, run_log_html
from partita.report.terminal import (
    alternatives_table,
    breakdown_table,
    compare_text,
    plan_text,
    run_log_tables,
    run_log_text,
    search_table,
    stages_table,
    summary_table,
)

__all__ = [
    "alternatives_table",
    "breakdown_table",
    "compare_text",
    "plan_html",
    "plan_text",
    "run_log_html",
    "run_log_tables",
    "run_log_text",
    "search_table",
    "stages_table",
    "summary_table",
]
