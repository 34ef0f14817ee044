"""The planner's search of one outer configuration under a zero-bubble schedule (ZB-H1, ZB-V; issue 19).

Called by ``search/planner.plan_graph`` for schedules with ``schedule.splits_backward``; sits beside
the planner (it drives a ``planner.Search`` it is handed, and imports nothing above ``search/``).
What differs from 1F1B:

* the space: the torch runtime splits the backward (``backends/torch/wsplit.py``) on stages with
  ZeRO-0 or ZeRO-1 and no activation recompute, so only those combos are searched
  (``RUNNABLE_ZERO``). ZeRO-1 keeps every replica's gradients whole until the step's one
  reduce-scatter, which the runner issues after the stage's last W. Left out, as
  ``backends/torch/emit.check_schedule`` refuses them: ZeRO-2/3, whose FSDP2 reduce-scatters (and
  reshards) a unit's gradients when its *input* gradient is done, i.e. at B, before W has computed
  them; and recompute, because W unpacks the checkpointed tensors in a second backward pass and so
  recomputes each block's forward a second time (more FLOPs than priced);
* the memory: a micro-batch between its B and its W keeps, besides its activations, the output
  gradients W needs. Each stage weighs that with its own layers (:func:`stage_held`: ``1 +`` the
  bytes of the outputs of its parameter ops over its saved activation bytes), so a head stage whose
  logits gradient is large does not price the blocks' stages. Every rank of a ``p``-stage ZB
  pipeline holds about what the most loaded one holds (:func:`counts`: the upper envelope of
  ``(forward-held, deferred)`` pairs over every rank's action list, ``schedule.peak_in_flight``
  evaluated at each stage's own weight), a function of ``p``, while the stage DP indexes in-flight
  counts by the stages *left*. So the stage options are priced once, with every range's count per
  number of stages (the first pass: counts indexed by stages left, later stages under-priced), and
  each pipeline depth ``P`` tried re-solves the DP on the same options with every stage at ``P``'s
  count and deeper pipelines barred, keeping its pick if it has exactly ``P`` stages. The depths
  tried: powers of two, and the depths (and one less) the first pass picks (those picks are kept
  where their later stages fit at the true count);
* the step: the simulated action list (``Candidate.pipeline``), below the closed form the DP bounds
  with, so the incumbent of other schedules prunes nothing here.

Cost: the stage arrays (times, memory, tails of every option and combo) are built once per outer
configuration; a depth's pass only re-reads which ranges fit at its count and solves the DP over
at most ``P`` stages.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import numpy as np

from partita.ir import Graph
from partita.search import schedule as sched
from partita.search.schedule_cost import layer_held_bytes

RUNNABLE_ZERO = (0, 1)  # ZeRO stages the torch runtime runs with a split backward (docstring)


def stage_held(graph: Graph, seq_len: int, first: int, last: int) -> float:
    """What a micro-batch of the stage of layers ``[first, last)`` weighs between its B and its W,
    in units of its saved activations: ``1 + output-gradient bytes / saved activation bytes``."""
    dy, act = layer_held_bytes(graph, seq_len)
    a = float(act[first:last].sum())
    return 1.0 + float(dy[first:last].sum()) / a if a > 0 else 1.0


def range_held(graph: Graph, seq_len: int, units: Sequence[tuple[int, int]]) -> np.ndarray:
    """``H[k, j]``: :func:`stage_held` of the stage of layer units ``[k, j)`` (1 where ``j <= k``)."""
    dy, act = layer_held_bytes(graph, seq_len)
    bounds = np.array([a for a, _ in units] + [units[-1][1]])
    cdy = np.concatenate([[0.0], np.cumsum(dy)])[bounds]
    cact = np.concatenate([[0.0], np.cumsum(act)])[bounds]
    sdy = cdy[None, :] - cdy[:-1, None]
    sact = cact[None, :] - cact[:-1, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(sact > 0, 1.0 + sdy / np.where(sact > 0, sact, 1.0), 1.0)


@functools.lru_cache(maxsize=512)
def _envelope(schedule: str, p: int, m: int, v: int) -> tuple[np.ndarray, np.ndarray]:
    """``(f, d)``: per number of deferred micro-batches ``d`` seen on any rank, the most micro-batches
    held whole with it (``/ v``); the count at weight ``h`` is ``max(f + h d)``, as
    ``schedule.peak_in_flight`` counts it on the same lists."""
    split = sched.splits_backward(schedule)
    best: dict[int, int] = {0: 0}
    if schedule == "zb_h1":
        for held_whole, num_deferred in _zb_h1_pairs(p, m):
            best[num_deferred] = max(best.get(num_deferred, 0), held_whole)
        orders: list[list[str]] = []
    else:
        orders = [[a.kind for a in acts] for acts in sched.pipeline_actions(schedule, p, m, v)]
    for order in orders:
        kinds = np.array(order)
        fwd = np.cumsum(np.where(kinds == "F", 1, np.where(kinds == "B", -1, 0)))
        dfr = np.cumsum(np.where(kinds == "B", int(split), np.where(kinds == "W", -1, 0)))
        for x in np.unique(dfr):
            best[int(x)] = max(best.get(int(x), 0), int(fwd[dfr == x].max()))
    vv = sched.virtual_stages(schedule, v)
    deferred = np.array(sorted(best), dtype=np.float64)
    whole = np.array([best[int(x)] for x in deferred], dtype=np.float64)
    return whole / vv, deferred / vv


def _zb_h1_pairs(p: int, m: int) -> list[tuple[int, int]]:
    """The ``(held whole, deferred)`` pairs that bound ZB-H1's counts, read off its order in O(p).

    Rank ``r`` runs ``a = min(p - 1 - r, m)`` warm-up forwards, then per micro-batch ``k = 1..m``: a
    forward while any is left, its ``k``-th B, and a W once ``r`` are deferred
    (``schedule._one_f_one_b_steps`` with ``defer=r``). Before the ``k``-th round ``min(k - 1, r)`` are
    deferred, so the points are ``(a, 0)`` after the warm-up, ``(a + 1, min(k - 1, r))`` after a forward
    (largest at ``k = m - a``) and ``(min(a, m - k), min(k, r + 1))`` after the ``k``-th B; the last is
    piecewise linear in ``k`` with breaks at ``m - a`` and ``r + 1``, so its ends and breaks bound it.
    ``tests/search/test_zero_bubble_search.py`` checks these against the action lists."""
    out = []
    for r in range(p):
        a = min(p - 1 - r, m)
        out.append((a, 0))
        if m - a >= 1:
            out.append((a + 1, min(m - a - 1, r)))
        for k in {1, m - a, r + 1, m}:
            if 1 <= k <= m:
                out.append((min(a, m - k), min(k, r + 1)))
    return out


def counts(schedule: str, p: int, m: int, v: int, held: np.ndarray) -> np.ndarray:
    """The most loaded rank's in-flight count of a ``p``-stage pipeline, per weight in ``held``."""
    f, d = _envelope(schedule, p, m, v)
    h = np.asarray(held, dtype=np.float64)
    return np.max(f[:, None] + d[:, None] * h.reshape(1, -1), axis=0).reshape(h.shape)


def stage_in_flight(graph: Graph, seq_len: int, schedule: str, p: int, m: int, v: int, first: int, last: int) -> float:
    """The count a ZB stage of layers ``[first, last)`` in a ``p``-stage pipeline is priced at."""
    return float(counts(schedule, p, m, v, np.array([stage_held(graph, seq_len, first, last)]))[0])


def in_flight_table(held: np.ndarray, schedule: str, m: int, v: int, max_stages: int) -> np.ndarray:
    """``[U, U + 1, S + 1]``: per layer range and number of stages ``s``, the count at ``s`` stages."""
    out = np.zeros((*held.shape, max_stages + 1))
    for s in range(1, max_stages + 1):
        out[:, :, s] = counts(schedule, s, m, v, held)
    return out


def solve_zero_bubble(search: Any, dp: int, b: int, schedule: str) -> list[Any]:
    """Best candidates of ``search.solve_config`` under ``schedule`` over the depths tried (docstring)."""
    opts = search.options
    zeros = tuple(z for z in opts.zero_stages if z in RUNNABLE_ZERO)
    if not zeros or "none" not in opts.recompute or (dp == 1 and 0 not in zeros):  # dp = 1 prices ZeRO-0 only
        return []
    v = sched.virtual_stages(schedule)
    m = search.training.global_batch // (b * dp)
    held = range_held(search.graph, search.training.seq_len, search.units)
    num_units = len(search.units)
    built: list[Any] = []
    options_for = search.options_for

    def first_options(*args: Any) -> Any:
        got = options_for(*args)
        built.append(got)
        return got

    search.options = dataclasses.replace(opts, zero_stages=zeros, recompute=("none",))
    search.in_flight = lambda _s, _m, _v, max_stages: in_flight_table(held, schedule, m, v, max_stages)
    search.options_for = first_options
    found: list[Any] = []
    try:
        first = search.solve_config(dp, b, schedule, v)  # counts by stages left: later stages under-priced
        found += first
        if built and built[0][0]:
            base, caps, mixed = built[0]
            max_stages = base[0].stack.shape[3] - 1
            depths = {2**k for k in range(num_units.bit_length()) if 2**k <= num_units}
            for c in first:
                depths |= {len(c.stages), max(1, len(c.stages) - 1)}
            for depth in sorted(d for d in depths if d <= max_stages):
                derived = [_at_depth(o, depth) for o in base]
                search.options_for = lambda *_a, derived=derived: (derived, caps, mixed)
                # a shallower pick was priced at this depth's count: only exact ones are kept
                found += [c for c in search.solve_config(dp, b, schedule, v) if len(c.stages) == depth]
    finally:
        search.options = opts
        search.__dict__.pop("in_flight", None)
        search.__dict__.pop("options_for", None)
    usable = search.factors.memory_usable
    return [  # the first pass's picks fit only if their later stages do at the true count
        c
        for c in found
        if all(
            c.memory(i) <= min(d.memory_bytes for d, _, _ in p.option.devices) * usable for i, p in enumerate(c.stages)
        )
    ]


def _at_depth(option: Any, depth: int) -> Any:
    """``option`` with every stage priced at ``depth`` stages' count and deeper pipelines barred: its
    stack's column ``depth`` (fits there or not) for ``1 .. depth`` stages, cut after ``depth``."""
    stack = option.stack
    col = stack[:, :, :, depth : depth + 1]
    new = np.concatenate([stack[:, :, :, :1], np.repeat(col, depth, axis=3)], axis=3)
    out = dataclasses.replace(option, stack=new)
    out.__dict__["tails"] = option.tails  # depth-independent (cached_property)
    return out
