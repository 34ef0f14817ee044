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
  gradients W needs. Each stage weighs that with its own layers (:func:`held_weight`: ``1 +`` the
  bytes of the outputs of its parameter ops over its saved activation bytes, both in the program's
  dtype and each stage option's own tp layout: :class:`HeldCounts`), so a head stage whose logits
  gradient is large does not price the blocks' stages. Under ZB-H1 the stage at position
  ``i`` runs rank ``i``'s action list, which holds ``p - i`` forwards and defers ``i`` W's: each
  position is priced at that list's own count (:func:`counts` with ``position``: the upper envelope
  of its ``(forward-held, deferred)`` pairs, ``schedule.peak_in_flight`` evaluated at the stage's own
  weight; ZB-V, whose ranks hold about the same, at the most loaded rank's). That count is a
  function of ``p`` and ``i``, while the stage DP indexes counts by the stages *left*
  (``s = p - i``). So a first pass prices every range at the most loaded rank's count of ``s``
  stages (:func:`_first_pass_table`, only an estimate for deeper pipelines) to find depths worth
  trying; each depth ``P`` tried (powers of two, and the depths, and one less, the first pass
  picks) then re-prices the stage options with column ``s`` at position ``P - s``'s count
  (:func:`in_flight_table`, ``P + 1`` columns: deeper pipelines are not priced) and keeps the
  DP's pick if it has exactly ``P`` stages; only those picks are candidates. With every position
  at the most loaded rank's count, the mixtral-8x7b plan's stages rehearsed 13-32% under their plan;
* the step: the simulated action list (``Candidate.pipeline``), below the closed form the DP bounds
  with, so the incumbent of other schedules prunes nothing here.

Cost: a depth's pass rebuilds the stage arrays (times, memory, tails of every option and combo:
numpy over the unit ranges; the layer tables they read are built once) with its table and solves
the DP over at most ``P`` stages.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import numpy as np

from partita.device_reserve import tensor_cap
from partita.search.pipeline import schedule as sched
from partita.search.pipeline import step_bounds

RUNNABLE_ZERO = (0, 1)  # ZeRO stages the torch runtime runs with a split backward (docstring)


def range_held_of(tab: Any) -> np.ndarray:
    """``H[k, j]``: :func:`held_weight` of each unit range ``[k, j)``, from the unit table of one
    option (``stage_cost.UnitTable``, already in its stage's precision mode): ``1 + held / saved``
    in the program's dtype and layout; unit 0 holds the model's first layer (1)."""
    act = tab.ranged("act")
    held = tab.ranged("held") if tab.held is not None else np.zeros_like(act)
    with np.errstate(divide="ignore", invalid="ignore"):
        out = np.where(act > 0, 1.0 + held / np.where(act > 0, act, 1.0), 1.0)
    out[0] = 1.0
    return out


class HeldCounts:
    """A stage option's in-flight table ``[U, U + 1, S + 1]``, made from its own held weights
    (:func:`range_held_of`) by ``table`` (``held -> counts``: :func:`in_flight_table` or
    :func:`_first_pass_table` with the pass's schedule and depth). ``stage_ranges.StageParts`` calls it
    with the option's unit table: the output gradients a deferred W reads depend on the option's tp
    layout and precision mode, which one table for every option (the traced graph unsharded in f32, as
    before) could not say: it weighed mixtral-8x7b's blocks 1.30, the program 1.16. Memoised per unit table (every ZeRO / recompute combo of a table)."""

    def __init__(self, table: Any) -> None:
        self.table = table
        self._got: dict[int, tuple[Any, np.ndarray]] = {}
        # per distinct weights: options of one device type and tp at other micro-batch sizes, or of other
        # types with the same layout, weigh their ranges alike (held and saved bytes scale together), so
        # gpt3-175b's 1024-GPU search builds 3378 tables for 8456 asks, search 10.5 -> 9.7 s (issue 20)
        self._by_weights: dict[tuple[tuple[int, ...], bytes], np.ndarray] = {}

    def __call__(self, tab: Any) -> np.ndarray:
        hit = self._got.get(id(tab))
        if hit is None or hit[0] is not tab:
            held = range_held_of(tab)
            key = (held.shape, held.tobytes())
            got = self._by_weights.get(key)
            if got is None:
                got = self._by_weights[key] = self.table(held)
            hit = self._got[id(tab)] = (tab, got)
        return hit[1]


@functools.lru_cache(maxsize=2048)
def _envelope(schedule: str, p: int, m: int, v: int, position: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """``(f, d)``: per number of deferred micro-batches ``d`` seen on the rank at ``position`` (any rank
    where None), the most micro-batches held whole with it (``/ v``); the count at weight ``h`` is
    ``max(f + h d)``, as ``schedule.peak_in_flight`` counts it on the same lists."""
    split = sched.splits_backward(schedule)
    ranks = range(p) if position is None else (position,)
    best: dict[int, int] = {0: 0}
    if schedule == "zb_h1":
        for held_whole, num_deferred in _zb_h1_pairs(p, m, ranks):
            best[num_deferred] = max(best.get(num_deferred, 0), held_whole)
        orders: list[list[str]] = []
    else:
        lists = sched.pipeline_actions(schedule, p, m, v)
        orders = [[a.kind for a in lists[r]] for r in ranks]
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


def _zb_h1_pairs(p: int, m: int, ranks: Sequence[int] | None = None) -> list[tuple[int, int]]:
    """The ``(held whole, deferred)`` pairs that bound ZB-H1's counts on ``ranks`` (all where None),
    read off its order in O(1) a rank.

    Rank ``r`` runs ``a = min(p - 1 - r, m)`` warm-up forwards, then per micro-batch ``k = 1..m``: a
    forward while any is left, its ``k``-th B, and a W once ``r`` are deferred
    (``schedule._one_f_one_b_steps`` with ``defer=r``). Before the ``k``-th round ``min(k - 1, r)`` are
    deferred, so the points are ``(a, 0)`` after the warm-up, ``(a + 1, min(k - 1, r))`` after a forward
    (largest at ``k = m - a``) and ``(min(a, m - k), min(k, r + 1))`` after the ``k``-th B; the last is
    piecewise linear in ``k`` with breaks at ``m - a`` and ``r + 1``, so its ends and breaks bound it.
    ``tests/search/test_zero_bubble_search.py`` checks these against the action lists."""
    out = []
    for r in range(p) if ranks is None else ranks:
        a = min(p - 1 - r, m)
        out.append((a, 0))
        if m - a >= 1:
            out.append((a + 1, min(m - a - 1, r)))
        for k in {1, m - a, r + 1, m}:
            if 1 <= k <= m:
                out.append((min(a, m - k), min(k, r + 1)))
    return out


def per_position(schedule: str) -> bool:
    """Does each pipeline position get its own count? ZB-H1: rank ``r`` holds ``p - r`` forwards and
    defers ``r`` W's, so its count grows with ``r`` where a deferred micro-batch weighs more than one
    held whole (and the program's stage at position ``r`` runs exactly rank ``r``'s list). ZB-V and
    the others: every position at the most loaded rank's count (ZB-V's ranks hold about the same)."""
    return schedule == "zb_h1"


def counts(schedule: str, p: int, m: int, v: int, held: np.ndarray, position: int | None = None) -> np.ndarray:
    """The in-flight count of a ``p``-stage pipeline, per weight in ``held``: of the rank at
    ``position`` (ZB-H1, :func:`per_position`), else of the most loaded rank."""
    f, d = _envelope(schedule, p, m, v, position if per_position(schedule) else None)
    h = np.asarray(held, dtype=np.float64)
    return np.max(f[:, None] + d[:, None] * h.reshape(1, -1), axis=0).reshape(h.shape)


def in_flight_table(held: np.ndarray, schedule: str, m: int, v: int, num_stages: int) -> np.ndarray:
    """``[U, U + 1, num_stages + 1]`` for a pipeline of exactly ``num_stages`` stages: per layer range
    and number of stages left ``s`` (the stage at position ``num_stages - s``, as the stage DP and
    ``Candidate.memory`` index them), that position's count (:func:`counts`)."""
    out = np.zeros((*held.shape, num_stages + 1))
    for s in range(1, num_stages + 1):
        out[:, :, s] = counts(schedule, num_stages, m, v, held, num_stages - s)
    return out


def _first_pass_table(held: np.ndarray, schedule: str, m: int, v: int, max_stages: int) -> np.ndarray:
    """The first pass's ``[U, U + 1, S + 1]``: per number of stages ``s``, the most loaded rank's count
    of an ``s``-stage pipeline (an estimate for the stage with ``s`` stages left of a deeper one)."""
    out = np.zeros((*held.shape, max_stages + 1))
    for s in range(1, max_stages + 1):
        out[:, :, s] = counts(schedule, s, m, v, held)
    return out


def least_counts(schedule: str, m: int, max_stages: int) -> np.ndarray | None:
    """``[0, min(1, m), ..., min(S, m)]``: no more than the count of the stage with ``s`` stages left
    in a ZB-H1 pipeline of any depth ``P >= s`` (position ``P - s`` runs ``min(s - 1, m)`` warm-up
    forwards and then one more forward while any is left, :func:`_zb_h1_pairs`, each held whole:
    ``min(s, m)``; deferred W's only add), whatever the stage's held weight. None for the schedules
    it is not proved for. ``tests/search/test_zero_bubble_search.py`` checks it against
    :func:`counts`."""
    if schedule != "zb_h1":
        return None
    return np.array([0.0] + [float(min(s, m)) for s in range(1, max_stages + 1)])


def solve_zero_bubble(search: Any, dp: int, b: int, schedule: str, incumbent: float = float("inf")) -> list[Any]:
    """Best candidates of ``search.solve_config`` under ``schedule`` over the depths tried (docstring).

    Rule R6 first (``step_bounds.can_beat``): priced with :func:`least_counts`, no larger than any
    count the passes price with, where nothing fits with stages fast enough to beat ``incumbent``
    (this schedule's best step so far; inf: where nothing fits at all), no depth can give this
    schedule's best plan, and none is tried. The depth passes skip solves that cannot beat
    ``incumbent`` as ``solve_config`` does; the first pass, whose counts are estimates and only pick
    depths, never does."""
    opts = search.options
    zeros = tuple(z for z in opts.zero_stages if z in RUNNABLE_ZERO)
    if not zeros or "none" not in opts.recompute or (dp == 1 and 0 not in zeros):  # dp = 1 prices ZeRO-0 only
        return []
    v = sched.virtual_stages(schedule)
    m = search.training.global_batch // (b * dp)
    num_units = len(search.units)
    built: list[Any] = []
    options_for = search.options_for

    def first_options(*args: Any) -> Any:
        got = options_for(*args)
        built.append(got)
        return got

    search.options = dataclasses.replace(opts, zero_stages=zeros, recompute=("none",))
    search.options_for = first_options
    found: list[Any] = []
    try:
        with search.sharing_stage_parts():  # each depth re-prices the same options (Search.stage_parts)
            floor = functools.partial(least_counts, schedule, m)
            if incumbent < float("inf") and step_bounds.time_floor(search, dp, b, schedule, v, incumbent) > incumbent:
                search.stats.configs_cut += 1  # not even its fastest ranges, memory aside, can win
                return []
            if floor(1) is not None:
                with search.pricing_in_flight(floor):
                    if not step_bounds.can_beat(search, dp, b, schedule, v, incumbent):  # nothing fits, or cannot win
                        search.stats.configs_cut += 1
                        return []
            first_pass = functools.lru_cache(maxsize=None)(
                lambda max_stages: HeldCounts(lambda held: _first_pass_table(held, schedule, m, v, max_stages))
            )
            with search.pricing_in_flight(first_pass):
                first = search.solve_config(dp, b, schedule, v)  # counts by stages left: later stages under-priced
            search.__dict__.pop("options_for", None)
            if built and built[0][0]:
                max_stages = built[0][0][0].stack.shape[3] - 1
                depths = {2**k for k in range(num_units.bit_length()) if 2**k <= num_units}
                for c in first:
                    depths |= {len(c.stages), max(1, len(c.stages) - 1)}
                for depth in sorted(d for d in depths if d <= max_stages):
                    # every position at its own count in a pipeline of exactly `depth` stages; the table's
                    # `depth + 1` columns bound the DP's stages (inter_op: times.shape[3] - 1), so deeper
                    # pipelines are not priced at all (and the arrays are as narrow as the depth)
                    table = HeldCounts(lambda held, d=depth: in_flight_table(held, schedule, m, v, d))
                    with search.pricing_in_flight(lambda _n, t=table: t):
                        found += search.solve_config(
                            dp, b, schedule, v, incumbent=incumbent, keep=lambda c, d=depth: _kept(search, c, d)
                        )
    finally:
        search.options = opts
        search.__dict__.pop("options_for", None)
    return found


def _kept(search: Any, c: Any, depth: int) -> bool:
    """A depth pass keeps a candidate of exactly its depth whose every stage fits at its own position's
    count, as ``Candidate.memory`` reads it (the DP's fits, checked)."""
    return len(c.stages) == depth and all(
        c.memory(i) <= min(tensor_cap(d) for d, _, _ in p.option.devices) for i, p in enumerate(c.stages)
    )
