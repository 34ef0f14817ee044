"""Formatting shared by the report views: numbers with units, plurals, the output width, and the
device counts of a plan (how many of the cluster's devices it uses, by type).

Part of ``report/`` (top of the flow): pure functions of numbers and of a Plan, no rich, no HTML.
The terminal view (``terminal.py``) and the page (``html.py``) both format through these, so the
two say the same numbers.
"""

from __future__ import annotations

import os
import shutil
import sys
from typing import Any

from partita.plan import Plan

WIDTH = 110  # columns when the output is not a terminal and COLUMNS is unset (files, goldens, pipes)
MIN_WIDTH = 40


def output_width(width: int | None = None) -> int:
    """``width`` if given; else ``$COLUMNS``; else the terminal's width on a TTY; else :data:`WIDTH`."""
    if width is not None:
        return max(MIN_WIDTH, int(width))
    cols = os.environ.get("COLUMNS", "").strip()
    if cols.isdigit() and int(cols) > 0:
        return max(MIN_WIDTH, int(cols))
    if sys.stdout.isatty():
        return max(MIN_WIDTH, shutil.get_terminal_size((WIDTH, 24)).columns)
    return WIDTH


def plural(n: int, word: str, many: str | None = None) -> str:
    """``1 stage``, ``2 stages``, ``1 micro-batch``; ``many`` for irregular plurals."""
    return f"{n} {word if n == 1 else (many or word + 's')}"


def time_s(x: Any) -> str:
    """Seconds as ``12.3 ms`` below one second, ``1.234 s`` above; ``-`` for none."""
    if x is None:
        return "-"
    x = float(x)
    return f"{x * 1e3:.1f} ms" if abs(x) < 1 else f"{x:.3f} s"


def gib(x: Any) -> str:
    """Bytes in GiB (device memory); below 0.01 GiB in the unit that shows them (``3.2 MiB``)."""
    if x is None:
        return "-"
    return f"{float(x) / 2**30:.2f} GiB" if abs(float(x)) >= 0.01 * 2**30 or not float(x) else nbytes(x)


def pct(x: Any, signed: bool = False) -> str:
    if x is None:
        return "-"
    return f"{100 * float(x):+.1f}%" if signed else f"{100 * float(x):.1f}%"


def nbytes(x: Any) -> str:
    """A byte count readable at any size (``512 B``, ``4.0 KiB``, ``2.86 MiB``); ``-`` for none or 0."""
    if x is None or float(x) <= 0:
        return "-"
    b = float(x)
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if b >= scale:
            return f"{b / scale:.2f} {unit}" if unit != "KiB" else f"{b / scale:.1f} {unit}"
    return f"{b:.0f} B"


def mem_cap(plan: Plan, device_type: str) -> float | None:
    """Memory capacity in bytes of one device of ``device_type`` in the plan's cluster, if recorded."""
    for g in plan.cluster.get("spec", {}).get("groups", []):
        if g["device"]["name"] == device_type:
            return float(g["device"]["memory_bytes"])
    return None


def cluster_devices(plan: Plan) -> dict[str, int]:
    """Device type -> number of devices in the plan's cluster (empty when the plan records no spec)."""
    out: dict[str, int] = {}
    for g in plan.cluster.get("spec", {}).get("groups", []):
        name = str(g["device"]["name"])
        out[name] = out.get(name, 0) + int(g["num_nodes"]) * int(g["gpus_per_node"])
    return out


def used_devices(plan: Plan) -> dict[str, int]:
    """Device type -> number of devices the plan's stages use (a mixed stage counts per replica)."""
    out: dict[str, int] = {}
    for s in (group[0] for group in plan.positions()):  # model chunks of a rank group count once
        if s.replica_device_types:
            for name in s.replica_device_types:
                out[name] = out.get(name, 0) + s.tp
        else:
            out[s.device_type] = out.get(s.device_type, 0) + len(s.ranks)
    return out


def devices_phrase(plan: Plan) -> str:
    """``16 of 40 devices`` (or ``6 devices`` when the plan records no cluster spec)."""
    total = sum(cluster_devices(plan).values())
    if total and total != plan.world_size:
        return f"{plan.world_size} of {plural(total, 'device')}"
    return plural(plan.world_size, "device")


def counts_text(counts: dict[str, int]) -> str:
    return ", ".join(f"{n} x {name}" for name, n in counts.items())
