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
    """Usable memory in bytes of one device of ``device_type``: the tensor capacity the search held every
    stage under (``predicted["memory_reserve"][type]["tensor_cap"]``: the device memory less its CUDA
    context, NCCL buffers and allocator margin, ``partita/device_reserve.py``), so compile, the HTML page
    and the search say one capacity (issue 35). An older plan's ``memory_usable`` fraction of the device
    memory, else the whole of it; ``None`` when the plan records no cluster spec."""
    reserve = plan.predicted.get("memory_reserve", {}).get(device_type)
    if reserve:
        return float(reserve["tensor_cap"])
    for g in plan.cluster.get("spec", {}).get("groups", []):
        if g["device"]["name"] == device_type:
            return float(g["device"]["memory_bytes"]) * usable_fraction(plan)
    return None


def usable_fraction(plan: Plan) -> float:
    """The fraction of device memory the search let plans use (1.0 when the plan does not record it)."""
    return float(plan.predicted.get("memory_usable") or 1.0)


def stage_types(stage: Any) -> list[str]:
    """The device types a stage runs on, in replica order, each once (``mixed`` stages list several)."""
    return list(dict.fromkeys(stage.replica_device_types)) or [stage.device_type]


def stage_memory(plan: Plan, stage: Any) -> list[tuple[str, float | None, float | None]]:
    """Per device type of ``stage``: ``(type, predicted bytes per device, usable bytes)``. The search
    prices one memory figure per stage and holds it under the usable memory of every type the stage
    spans (the smallest decides), so a mixed stage's V100 row shows the V100's own, smaller headroom."""
    mem = stage.predicted.get("memory_bytes")
    return [(t, float(mem) if mem else None, mem_cap(plan, t)) for t in stage_types(stage)]


def time_unit(values: Any) -> str:
    """``"s"`` when any of ``values`` (seconds) is a second or more, else ``"ms"``: one unit per table."""
    return "s" if any(v is not None and abs(float(v)) >= 1 for v in values) else "ms"


def time_in(x: Any, unit: str, signed: bool = False) -> str:
    """Seconds in ``unit`` (``"s"``: 3 decimals, ``"ms"``: 1 decimal); ``-`` for none."""
    if x is None:
        return "-"
    v, fmt = (float(x), ".3f") if unit == "s" else (float(x) * 1e3, ".1f")
    return f"{v:{'+' if signed else ''}{fmt}} {unit}"


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


def stage_count_phrase(plan: Plan) -> str:
    """The one stage vocabulary of every report view (issue 35): a *stage* is one row of the plan's
    stage list (a contiguous layer range; a "virtual stage" or model chunk in a chunked plan); a
    *rank group* is the ranks of one pipeline position. ``4 stages`` in a plain pipeline; ``4 stages
    on 2 rank groups (2 stages each)`` when rank groups hold several stages (zbv, interleaved)."""
    n = plan.num_stages
    if not plan.chunked:
        return plural(n, "stage")
    p = plan.num_positions
    return f"{plural(n, 'stage')} on {plural(p, 'rank group')} ({n // max(1, p)} each)"


def group_busy(plan: Plan) -> list[tuple[int, list[int], list[str], float | None]]:
    """Per rank group: ``(group, its stage indices, its device types, busy share of the step)``; busy
    = micro-batches x the group's stages' predicted time per micro-batch, over the step time (None
    when the plan records no times). The time breakdown is the critical path's; this is how long
    every other group works, so an idle row in the pipeline chart has its number (issue 35)."""
    step = float(plan.predicted.get("step_time_s") or 0)
    out = []
    for r, group in enumerate(plan.positions()):
        times = [s.predicted.get("time_s", s.predicted.get("compute_s")) for s in group]
        known = step > 0 and all(t is not None for t in times)
        busy = min(1.0, plan.num_micro_batches * sum(float(t or 0) for t in times) / step) if known else None
        types = list(dict.fromkeys(t for s in group for t in stage_types(s)))
        out.append((r, [s.index for s in group], types, busy))
    return out


def utilization_text(plan: Plan) -> str:
    """``rank group 0 (stages 0, 3; A100-80G) busy 92.5% of the step, rank group 1 (...) 73.5%``."""
    parts = []
    for r, idx, types, busy in group_busy(plan):
        if busy is None:
            continue
        stages = f"stage{'s' if len(idx) > 1 else ''} {', '.join(map(str, idx))}"
        parts.append(f"rank group {r} ({stages}; {', '.join(types)}) busy {pct(busy)}")
    return ", ".join(parts)
