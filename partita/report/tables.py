"""Rich tables rendered to plain text at the output's width: columns wrap (fold), never truncate.

Part of ``report/``; the one place the report views make and render rich tables (``terminal.py``
for plans, ``run_log_view.py`` for run logs).
"""

from __future__ import annotations

import io
import re
from collections.abc import Sequence
from typing import Any

from rich.console import Console
from rich.table import Table

from partita.report.fmt import output_width


def render(*tables: Any, width: int | None = None) -> str:
    """Tables as plain text at ``width`` columns (default :func:`fmt.output_width`)."""
    w = output_width(width)
    for t in tables:
        if isinstance(t, Table):
            _fit_widths(t, w)
    buf = io.StringIO()
    con = Console(file=buf, width=output_width(width), color_system=None, force_terminal=False, legacy_windows=False)
    for t in tables:
        con.print(t)
    text = buf.getvalue().replace(GLUE, " ")
    return "\n".join(line.rstrip() for line in text.rstrip().splitlines()) + "\n"


GLUE = "\u00a4"  # stands for the space between a number and its unit while rich wraps (never in report text)
_NUMBER_UNIT = re.compile(r"(\d) (ms|s|us|GiB|MiB|KiB|B|GB|TFLOP/s|Gb/s|tokens/s)(?=$|[\s,;:)])")


def glue_units(cell: str) -> str:
    """``1.390 s`` with the space glued, so a column folds between words, never between a number and
    its unit (``render`` puts the space back)."""
    return _NUMBER_UNIT.sub(lambda m: m.group(1) + GLUE + m.group(2), cell)


SHORT = 10  # a cell this short stays on one line when it can
MAX_WORD = 20  # a column gets at least its longest word, up to this many characters, when it can


def _unbroken(cell: str) -> int:
    """Width a cell wants unbroken: all of a short value ("2 x 2", "0-15"), else its longest word."""
    return len(cell) if len(cell) <= SHORT else max((len(w) for w in cell.split()), default=1)


def _fit_widths(t: Table, width: int) -> None:
    """Give each column of a table wider than ``width`` a fixed width: at least its longest word (up
    to :data:`MAX_WORD`), the rest of the room shared max-min fairly. rich's
    own collapse ignores minimum widths and then crops the table; fixed widths fold instead."""
    cols = list(t.columns)
    if not cols:
        return
    room = width - (3 * len(cols) + 1)  # borders and one space of padding either side of each cell
    texts = [[str(c.header) if t.show_header else "", *(str(x) for x in c._cells)] for c in cols]
    most = [max((len(line) for x in tx for line in x.splitlines()), default=1) or 1 for tx in texts]
    if sum(most) <= room:
        return
    least = [  # headers may wrap between words; short values stay whole
        min(MAX_WORD, m, max([max((len(w) for w in tx[0].split()), default=1), *(_unbroken(x) for x in tx[1:])]))
        for tx, m in zip(texts, most)
    ]
    while sum(least) > room and max(least) > 3:
        least[least.index(max(least))] -= 1
    widths = list(least)
    spare = room - sum(widths)
    while spare > 0:  # max-min fair: an equal share each, a column that needs less takes only that
        needy = [k for k in range(len(cols)) if most[k] > widths[k]]
        if not needy:
            break
        share = max(1, spare // len(needy))
        for k in needy:
            give = min(share, most[k] - widths[k], spare)
            widths[k] += give
            spare -= give
    for c, w in zip(cols, widths):
        c.width = max(1, w)


def table(
    title: str, header: Sequence[str], rows: Sequence[Sequence[str]], show_header: bool = True, caption: str = ""
) -> Table:
    """A table whose columns wrap (fold) instead of truncating (widths: :func:`_fit_widths`)."""
    t = Table(title=title, show_header=show_header, caption=caption or None, caption_justify="left")
    for h in header:
        t.add_column(h, overflow="fold")
    for r in rows:
        t.add_row(*[glue_units(str(x)) for x in r])
    return t
