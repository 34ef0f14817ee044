"""Event simulation of a pipeline schedule's action lists: step time, bubbles and in-flight activations.

Sits in ``search/`` next to ``schedule.py`` (which generates the lists): the planner calls
``simulate`` for a candidate's final step time, ``plan.predicted`` records its result and the
report's chart draws its timeline. Semantics are those of the runtimes: each rank runs its actions
one at a time in list order; a send is posted without waiting (isend) and a receive blocks until the
data arrived, so an action starts when its rank is free and its inputs are there:

* ``F(s, m)`` after ``F(s-1, m)`` ended plus the p2p time of boundary ``s-1``;
* ``B(s, m)`` after ``F(s, m)`` and after ``B(s+1, m)`` ended plus the p2p time of boundary ``s``;
* ``W(s, m)`` after ``B(s, m)``.

Stages on the same rank (ZB-V's turn of the V) pass tensors without p2p. When the schedule does not
split the backward, ``B`` costs ``b + w`` (the full backward). A list whose order cannot be run (a rank
waits on an action that waits on it) raises ``ScheduleDeadlock``. No torch or JAX here.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

from partita.errors import PartitaError
from partita.search.pipeline.schedule import (
    Action,
    pipeline_actions,
    rank_orders,
    splits_backward,
    stage_rank,
    virtual_stages,
)


class ScheduleDeadlock(PartitaError):
    """An action order that blocks forever with buffered sends and blocking receives."""


@dataclasses.dataclass(frozen=True)
class Box:
    rank: int
    action: Action
    start_s: float
    end_s: float


@dataclasses.dataclass(frozen=True)
class SimResult:
    step_s: float  # last action's end (the pipeline part of the step)
    busy_s: tuple[float, ...]  # per rank: compute time
    idle_s: tuple[float, ...]  # per rank: step_s - busy_s (the bubble that rank sees)
    peak_in_flight: tuple[int, ...]  # per virtual stage: micro-batches held (F ran, last backward part not)
    peak_activations: tuple[int, ...]  # per virtual stage: micro-batches with F ran and B not
    boxes: tuple[Box, ...]  # every action with its start and end, in start order

    @property
    def bubble_s(self) -> float:
        """The busiest rank's idle time: what the step loses to the schedule."""
        return self.step_s - max(self.busy_s)


def _per_stage(x: float | Sequence[float], n: int, name: str) -> list[float]:
    vals = [float(x)] * n if isinstance(x, (int, float)) else [float(t) for t in x]
    if len(vals) != n or any(t < 0 for t in vals):
        raise ValueError(f"{name}: need {n} non-negative values, got {vals!r}")
    return vals


def simulate(
    schedule: str,
    num_ranks: int,
    num_micro: int,
    f: float | Sequence[float],
    b: float | Sequence[float],
    w: float | Sequence[float] = 0.0,
    p2p: float | Sequence[float] = 0.0,
    num_virtual: int = 1,
    actions: list[list[Action]] | None = None,
) -> SimResult:
    """Run the schedule's action lists (or ``actions``) with per-virtual-stage F, B, W times.

    ``b`` is the input-gradient part and ``w`` the weight-gradient part of a stage's backward;
    ``p2p`` the time to send one boundary tensor from stage ``s`` to ``s + 1`` (the same both ways).
    """
    v = virtual_stages(schedule, num_virtual)
    n_st = num_ranks * v
    ft, bt, wt = _per_stage(f, n_st, "f"), _per_stage(b, n_st, "b"), _per_stage(w, n_st, "w")
    comm = _per_stage(p2p, max(n_st - 1, 0), "p2p")
    split = splits_backward(schedule)
    if actions is None:
        lists, table = pipeline_actions(schedule, num_ranks, num_micro, v), _dag(schedule, num_ranks, num_micro, v)
    else:
        orders = [[(a.stage, a.micro, a.kind) for a in acts] for acts in actions]
        lists, table = actions, _compile(schedule, orders, num_ranks, v)
    start, end = _run(table, ft, bt, wt, comm, split)
    stage, kind, rank, micro = table[0], table[1], table[7], table[8]
    boxes = [Box(rank[i], Action(stage[i], micro[i], "FBW"[kind[i]]), start[i], end[i]) for i in range(len(stage))]
    held, acts = _peaks(lists, n_st, "W" if split else "B")
    step = max(end, default=0.0)
    busy = _busy(table, ft, bt, wt, split, num_ranks)
    return SimResult(
        step,
        tuple(busy),
        tuple(step - x for x in busy),
        held,
        acts,
        tuple(sorted(boxes, key=lambda x: (x.start_s, x.rank))),
    )


def _peaks(lists: list[list[Action]], n_st: int, last: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    held, acts = [0] * n_st, [0] * n_st
    peak_h, peak_a = [0] * n_st, [0] * n_st
    for rank_list in lists:
        for a in rank_list:
            s = a.stage
            if a.kind == "F":
                held[s] += 1
                acts[s] += 1
            if a.kind == "B":
                acts[s] -= 1
            if a.kind == last:
                held[s] -= 1
            peak_h[s], peak_a[s] = max(peak_h[s], held[s]), max(peak_a[s], acts[s])
    return tuple(peak_h), tuple(peak_a)


@functools.lru_cache(maxsize=512)
def _dag(schedule: str, num_ranks: int, num_micro: int, num_virtual: int) -> tuple[tuple[int, ...], ...]:
    """:func:`_compile` of the schedule's own lists, once per shape."""
    v = virtual_stages(schedule, num_virtual)
    return _compile(schedule, rank_orders(schedule, num_ranks, num_micro, v), num_ranks, v)


def _compile(
    schedule: str, lists: Sequence[Sequence[tuple[int, int, str]]], num_ranks: int, v: int
) -> tuple[tuple[int, ...], ...]:
    """Action lists (``(stage, micro, kind)`` per action, :func:`rank_orders`) as a dependency-ordered
    table (columns), the form :func:`_run` executes.

    Retiring each rank's actions in list order as soon as their inputs exist gives an order that
    depends on the lists alone, never on the durations, so it is a topological order that holds for
    every set of stage times. Per action: stage, kind (0 F, 1 B, 2 W), the previous action of its rank,
    up to two inputs with the boundary whose p2p time they pay (-1: none), its rank and micro-batch.
    """
    n_st = num_ranks * v
    home = [stage_rank(schedule, s, num_ranks, v) for s in range(n_st)]
    # hop[s]: the boundary after stage s when its two sides run on different ranks (a p2p), else -1
    hop = [s if s + 1 < n_st and home[s] != home[s + 1] else -1 for s in range(n_st)]
    kinds = {"F": 0, "B": 1, "W": 2}
    index: dict[tuple[int, int, str], int] = {}
    cols: list[list[int]] = [[] for _ in range(9)]
    pos, last = [0] * num_ranks, [-1] * num_ranks
    remaining = sum(len(x) for x in lists)
    get = index.get
    while remaining:
        progressed = False
        for r in range(num_ranks):
            acts, i, n = lists[r], pos[r], len(lists[r])
            while i < n:
                s, m, kind = acts[i]
                h2 = h1 = -1
                d2: int | None = -1
                if kind == "F":  # input: the previous stage's forward of this micro-batch
                    if s > 0:
                        d1 = get((s - 1, m, "F"))
                        if d1 is None:
                            break
                        h1 = hop[s - 1]
                    else:
                        d1 = -1
                elif kind == "B":  # its own forward, and the next stage's backward
                    d1 = get((s, m, "F"))
                    if d1 is None:
                        break
                    if s + 1 < n_st:
                        d2 = get((s + 1, m, "B"))
                        if d2 is None:
                            break
                        h2 = hop[s]
                else:
                    d1 = get((s, m, "B"))
                    if d1 is None:
                        break
                row = (s, kinds[kind], last[r], d1, h1, d2, h2, r, m)
                for col, x in zip(cols, row, strict=True):
                    col.append(x)  # type: ignore[arg-type]  # d1, d2: None broke out above
                index[(s, m, kind)] = last[r] = len(cols[0]) - 1
                i += 1
                remaining -= 1
                progressed = True
            pos[r] = i
        if not progressed:
            stuck = {r: str(Action(*lists[r][pos[r]])) for r in range(num_ranks) if pos[r] < len(lists[r])}
            raise ScheduleDeadlock(
                f"the {schedule} action lists block: every rank waits ({stuck}).",
                "fix the order in search/pipeline/schedule.py so that each action's inputs come from earlier actions.",
            )
    return tuple(tuple(c) for c in cols)


def _durations(f: Sequence[float], b: Sequence[float], w: Sequence[float], split: bool) -> tuple[list[float], ...]:
    """Per kind (F, B, W), per stage: B is the whole backward (``b + w``) when the schedule does not split it."""
    return list(f), list(b) if split else [x + y for x, y in zip(b, w, strict=True)], list(w)


def _run(
    table: tuple[tuple[int, ...], ...],
    f: Sequence[float],
    b: Sequence[float],
    w: Sequence[float],
    comm: Sequence[float],
    split: bool,
) -> tuple[list[float], list[float]]:
    """Start and end of every action of ``table``: after its rank's previous one and its inputs (+ p2p)."""
    stage, kind, prev, d1, h1, d2, h2 = table[:7]
    dur = _durations(f, b, w, split)
    start, end = [0.0] * len(stage), [0.0] * len(stage)
    for i in range(len(stage)):
        t0 = end[prev[i]] if prev[i] >= 0 else 0.0
        if d1[i] >= 0:
            t = end[d1[i]] + (comm[h1[i]] if h1[i] >= 0 else 0.0)
            t0 = t if t > t0 else t0
        if d2[i] >= 0:
            t = end[d2[i]] + (comm[h2[i]] if h2[i] >= 0 else 0.0)
            t0 = t if t > t0 else t0
        start[i], end[i] = t0, t0 + dur[kind[i]][stage[i]]
    return start, end


def _busy(
    table: tuple[tuple[int, ...], ...], f: list[float], b: list[float], w: list[float], split: bool, num_ranks: int
) -> list[float]:
    """Per rank, the sum of its actions' durations, added in list order."""
    stage, kind, rank = table[0], table[1], table[7]
    dur = _durations(f, b, w, split)
    busy = [0.0] * num_ranks
    for i in range(len(stage)):
        busy[rank[i]] += dur[kind[i]][stage[i]]
    return busy


def step_time(
    schedule: str,
    num_ranks: int,
    num_micro: int,
    f: Sequence[float],
    b: Sequence[float],
    w: Sequence[float],
    p2p: Sequence[float] | None = None,
    num_virtual: int = 1,
) -> float:
    """``simulate(...).step_s`` without the timeline, on the cached table (the planner's path; tested equal)."""
    comm = list(p2p) if p2p is not None else [0.0] * max(len(f) - 1, 0)
    _, end = _run(_dag(schedule, num_ranks, num_micro, num_virtual), f, b, w, comm, splits_backward(schedule))
    return max(end, default=0.0)
