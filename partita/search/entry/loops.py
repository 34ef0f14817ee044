"""The outer loop of one schedule over the configurations, and what runs beside it.

Part of the search's entry (``planner.py`` calls it): :func:`schedule_loop` searches every ``(dp, b)``
configuration of one schedule; :func:`beside` runs the zero-bubble loops in a forked worker
(``prefetch.in_background``) while the planner runs the others, and :class:`Extras` (the graph's hash
and the yardstick's record) runs on whichever side has less to do.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Any

from partita.search.pipeline import schedule as sched
from partita.search.pipeline.inter_op import DPStats
from partita.search.pipeline.zero_bubble import solve_zero_bubble

if TYPE_CHECKING:
    from partita.search.program.plan_build import Candidate

# the ``planner.Search`` each function is handed (not imported: the planner imports this module)
Search = Any


def third(steps: list[float]) -> float:
    """The third smallest of ``steps`` (inf while there are fewer)."""
    return sorted(steps)[2] if len(steps) >= 3 else math.inf


def schedule_loop(
    search: Search, configs: list[tuple[int, int]], schedule: str, chunks: bool
) -> tuple[list[Candidate], list[str]]:
    """Every configuration of one schedule: its candidates and the progress lines. Rule R6 skips
    what cannot beat a step its candidates must beat to matter, read off this schedule's own
    candidates only (so the schedules are searched apart, in any order, with the same results):
    its best (the report compares the schedules' bests); where interleaved 1F1B is searched, its
    third best (the interleaved bases are the best three of all, and the third best of all is no
    worse); for ZB-H1 where ZB-V is, its third best multi-stage candidate (``_zbv_bases``)."""
    options = search.options
    own: list[Candidate] = []
    lines = []
    best = math.inf
    for dp, b in configs:
        bar = best
        if "interleaved_1f1b" in options.schedules and chunks:
            bar = max(bar, third([c.step_time for c in own]))
        if schedule == "zb_h1" and "zbv" in options.schedules and chunks:
            bar = max(bar, third([c.step_time for c in own if len(c.stages) > 1]))
        search.num_configs += 1
        found = solve_schedule(search, dp, b, schedule, bar)
        own.extend(found)
        if found:
            best = min(best, *(c.step_time for c in found))
            lines.append(f"dp={dp} b={b} {schedule}: {min(c.step_time for c in found):.4f} s")
    return own, lines


def beside(
    search: Search, configs: list[tuple[int, int]], schedules: list[str], chunks: bool, extras: Extras | None
) -> tuple[str | None, Any, list[Candidate], list[str], DPStats, int]:
    """What ``planner.plan_graph`` computes beside its search: the loops of ``schedules`` with what they
    added to ``search``'s counts (which are put back: the caller adds them, in a worker or not), and,
    given ``extras``, the graph's hash (the plan records it) and the yardstick's record."""
    stats, num = dataclasses.replace(search.stats), search.num_configs
    cands: list[Candidate] = []
    lines: list[str] = []
    for schedule in schedules:
        got, said = schedule_loop(search, configs, schedule, chunks)
        cands += got
        lines += said
    delta = DPStats(
        **{f.name: getattr(search.stats, f.name) - getattr(stats, f.name) for f in dataclasses.fields(stats)}
    )
    added = search.num_configs - num
    search.stats, search.num_configs = stats, num
    graph_hash, rec = (None, None) if extras is None else extras(search)
    return graph_hash, rec, cands, lines, delta, added


class Extras:
    """The graph's hash and the yardstick's record (``plan_graph``): computed by :func:`beside` or,
    ``here``, by ``planner._search`` after its own loops; the same values either way (the yardstick
    prices on a copy of the memo, ``hand_best.yardstick``). ``here`` where the side has zero-bubble
    loops: they cost about what the main side's loops, the yardstick and the hash cost together, and
    with all three beside them the main process waited, one core idle (issue 35)."""

    def __init__(self, yardstick: Any, here: bool) -> None:
        self.yardstick, self.here = yardstick, here

    def beside(self) -> Any:
        """What :func:`beside` is handed: ``None`` when this is computed here."""
        return None if self.here else self

    def __call__(self, search: Search) -> tuple[str, Any]:
        rec = None if self.yardstick is None else self.yardstick(search.training)
        return search.graph.hash(), rec


def solve_schedule(search: Search, dp: int, b: int, schedule: str, incumbent: float) -> list[Candidate]:
    """One outer configuration; zero-bubble schedules (issue 19) search as ``search/pipeline/zero_bubble.py`` says."""
    if not sched.splits_backward(schedule):
        return search.solve_config(dp, b, schedule, incumbent=incumbent)
    return solve_zero_bubble(search, dp, b, schedule, incumbent)
