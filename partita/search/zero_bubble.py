"""The planner's search of one outer configuration under a zero-bubble schedule (ZB-H1, ZB-V; issue 19).

Called by ``search/planner.plan_graph`` for schedules with ``schedule.splits_backward``; sits beside
the planner (it drives a ``planner.Search`` it is handed, and imports nothing above ``search/``).
What differs from 1F1B:

* the space: the torch runtime runs a split backward only on stages with ZeRO-0 and no recompute
  (``backends/torch/emit.check_schedule``; ``backends/torch/wsplit.py`` says why), so only those
  combos are searched;
* the memory: every rank of a ``p``-stage ZB pipeline holds about what the most loaded one holds
  (``schedule.in_flight`` prices all at that peak, a micro-batch between its B and its W weighing
  ``schedule_cost.w_held``), a function of ``p``, while the stage DP indexes in-flight counts by the
  stages *left*. So the DP runs once per pipeline depth ``P`` tried, with every stage priced at
  ``P``'s count and deeper pipelines barred, and keeps its pick if it has exactly ``P`` stages. The
  depths tried: powers of two, and the depths (and one less) the DP picks with the counts indexed
  by stages left (those picks are kept where their later stages fit at the true count);
* the step: the simulated action list (``Candidate.pipeline``), below the closed form the DP bounds
  with, so the incumbent of other schedules prunes nothing here.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from partita.search import schedule as sched
from partita.search.schedule_cost import w_held

BARRED = 1e30  # in-flight count of a depth not allowed in this pass (memory never fits)


def solve_zero_bubble(search: Any, dp: int, b: int, schedule: str) -> list[Any]:
    """Best candidates of ``search.solve_config`` under ``schedule`` over the depths tried (docstring)."""
    opts = search.options
    if 0 not in opts.zero_stages or "none" not in opts.recompute:
        return []
    v = sched.virtual_stages(schedule)
    m = search.training.global_batch // (b * dp)
    held = w_held(search.graph, search.training.seq_len)
    num_units = len(search.units)
    search.options = dataclasses.replace(opts, zero_stages=(0,), recompute=("none",))
    found: list[Any] = []
    try:
        first = search.solve_config(dp, b, schedule, v)  # counts by stages left: later stages under-priced
        found += first
        depths = {2**k for k in range(num_units.bit_length()) if 2**k <= num_units}
        for c in first:
            depths |= {len(c.stages), max(1, len(c.stages) - 1)}
        for depth in sorted(depths):
            count = sched.in_flight(schedule, 0, depth, m, v, w_held=held)
            row = np.array([0.0] + [count] * depth + [BARRED] * (num_units - depth))
            search.in_flight = lambda _s, _m, _v, max_stages, row=row: row[: max_stages + 1]
            # a shallower pick was priced at this depth's count: only exact ones are kept
            found += [c for c in search.solve_config(dp, b, schedule, v) if len(c.stages) == depth]
    finally:
        search.options = opts
        search.__dict__.pop("in_flight", None)
    usable = search.factors.memory_usable
    return [  # the first pass's picks fit only if their later stages do at the true count
        c
        for c in found
        if all(
            c.memory(i) <= min(d.memory_bytes for d, _, _ in p.option.devices) * usable for i, p in enumerate(c.stages)
        )
    ]
