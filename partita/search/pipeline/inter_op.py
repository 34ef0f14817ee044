"""Inter-operator DP: split the layer sequence into pipeline stages and give each a device group.

Sits between ``stage_cost.py`` (which prices one stage option on a layer range) and ``planner.py``
(which runs this DP for every outer configuration and writes the Plan). The problem, after Alpa's
stage DP extended to device types as in Metis / AMP:

* the model is ``U`` layer units; a stage is a range ``[k, j)`` of units and an *option* ``o``: a
  device class (one device type, or a fixed mix of types whose data-parallel replicas get uneven
  batch shares) and a width (slots of that class: ``tp`` for a ``dp x tp`` mesh, ``dp`` being fixed
  by the outer loop);
* ``times[o, k, j, s]`` is the stage's period per micro-batch when ``s`` stages remain including it
  (so its in-flight activations are known), ``inf`` when it does not fit in memory;
* device classes form *segments* visited in a fixed order, each with a capacity in slots; a
  segment may hold zero stages and slots may stay unused;
* objective ``alpha * sum_s t_s + beta * max_s t_s`` (``schedule.coefficients``).

For a fixed bound ``t_max`` the DP over (segment i, stages left s, first unit k, slots left c) is::

    G[i][s][k][c] = min( G[i+1][s][k][cap_{i+1}],                               # leave segment i
                         min_{o in i, j > k, t=times[o,k,j,s] <= t_max} t + G[i][s-1][j][c - w_o] )
    G[i][0][U][c] = 0

and the answer is ``min_s G[0][s][0][cap_0]``, vectorized with numpy over (j, c). The outer loop
enumerates ``t_max`` over the distinct stage times, ascending from the smallest feasible one (found
by bisection, feasibility being monotone in ``t_max``).

Pruning rules (each documented, none silent; the counts are returned):

* R1 (here): stop enumerating ``t_max`` once ``alpha * sum_inf + beta * t_max >= best`` where
  ``sum_inf`` is the unconstrained minimum of ``sum_s t_s`` (a lower bound): exact.
* R2 (here): thin the ``t_max`` candidates so consecutive ones differ by more than ``epsilon``
  relative; the result is within a factor ``(1 + epsilon)`` of the DP optimum. ``epsilon=0`` is exact.
* R3 (``planner``): layer units group consecutive layers so that ``U <= max_layer_units``.
* R4 (``planner``): GPipe is only searched on request (1F1B has its latency with no more memory).
* R5 (``planner``): device types are visited in descending memory per device (1F1B keeps the most
  activations in the first stages); tensor parallelism stays within a node.
* R6 (``planner``): a candidate's simulated step is at least ``m`` times its slowest stage's period
  plus a bound on its tail (a rank runs its ``m`` micro-batches' actions one after another), so a
  solve keeps only stages no slower than the period that could still beat the best step of its
  schedule so far (``solve_stages``' ``t_limit``, ``step_bounds.t_limit``): where none fits, the
  solve, or the whole zero-bubble configuration (``step_bounds.can_beat``), ends after one DP run. Each
  schedule's best is still found; the configurations are visited likeliest first
  (``step_bounds.area_floor``). The DP's closed form is no such bound: a pipeline whose slowest stage
  comes first simulates below it.
* R8 (here): branch and bound over the ``t_max`` candidates instead of an ascending scan: on a
  candidate interval ``[a, b]`` the objective is at least ``alpha * G(t_b) + beta * t_a`` (``G``,
  the least stage-time sum under a bound, does not grow with it), so intervals that cannot beat the
  best are dropped unpriced; exact, and the same solution as the scan (``scan_stages``, kept as the
  tests' reference).
* R9 (``planner``): a model whose parameter + gradient + optimizer bytes exceed the usable memory of
  the whole cluster fails before any configuration is priced.
* R10 (here, ``stage_problem``): a segment whose capacity admits ``S`` stages of its widest option
  drops its slot dimension (exact).
* R7 (``planner``): the step's tail (largest per-stage exposed gradient sync + optimizer step)
  is outside this objective; the planner re-solves with the ZeRO / recompute combos capped below
  the last solution's tail until no stage sequence under the cap can win (R6, ``Search.solve_config``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

import numpy as np

INF = math.inf


@dataclasses.dataclass(frozen=True)
class StageProblem:
    """Input of :func:`solve_stages`. Arrays are indexed ``[option, k, j, s]`` as in the module doc."""

    times: np.ndarray  # float64 [O, U, U + 1, S + 1]
    option_segment: tuple[int, ...]  # per option
    option_width: tuple[int, ...]  # per option, slots
    capacities: tuple[int, ...]  # per segment, slots
    alpha: float = 1.0
    beta: float = 0.0

    @property
    def num_units(self) -> int:
        return int(self.times.shape[1])

    @property
    def max_stages(self) -> int:
        return int(self.times.shape[3]) - 1


@dataclasses.dataclass(frozen=True)
class StageSolution:
    stages: tuple[tuple[int, int, int], ...]  # (k, j, option) in pipeline order
    stage_times: tuple[float, ...]
    objective: float  # alpha * sum + beta * max, on the actual stage times


@dataclasses.dataclass
class DPStats:
    dp_runs: int = 0
    t_max_tried: int = 0
    t_max_candidates: int = 0
    t_max_thinned: int = 0  # R2
    t_max_cut: int = 0  # R1
    stage_candidates: int = 0  # finite (option, k, j, s) entries priced
    tail_caps: int = 0  # R7: re-solves with the ZeRO / recompute combos capped by tail
    configs_cut: int = 0  # R6: zero-bubble configurations whose step bound cannot beat the best plan

    def add(self, other: DPStats) -> None:
        for f in dataclasses.fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))


@dataclasses.dataclass(frozen=True)
class _Table:
    """The least time over a (segment, width)'s options, indexed for :func:`_run`."""

    width: int
    tab: np.ndarray  # [U, U + 1, S + 1] min over the group's options of times[o, k, j, s]
    diag: np.ndarray  # [U, U, S + 1] diag[k, d, s] = tab[k, k + 1 + d, s] (inf past the last unit)
    shortest: np.ndarray  # [U + 1, S + 1] least time of a stage of d units with s stages left


def _tables(p: StageProblem) -> list[list[_Table]]:
    """Per segment, the tables of its widths (options of one segment and width enter G only
    through their least time; the reconstruction still names the option). Built once per problem."""
    got = _TABLES.get(id(p))
    if got is not None and got[0] is p:
        return got[1]
    num_units = p.num_units
    groups: dict[tuple[int, int], list[int]] = {}
    for o, seg in enumerate(p.option_segment):
        if p.option_width[o] <= p.capacities[seg]:
            groups.setdefault((seg, p.option_width[o]), []).append(o)
    by_seg: list[list[_Table]] = [[] for _ in p.capacities]
    rows = np.arange(num_units)[:, None]
    cols = rows + 1 + np.arange(num_units)[None, :]
    for (seg, w), members in sorted(groups.items()):
        tab = p.times[members].min(axis=0) if len(members) > 1 else p.times[members[0]]
        padded = np.concatenate([tab, np.full((num_units, num_units, tab.shape[2]), INF)], axis=1)
        diag = padded[rows, cols]
        shortest = np.concatenate([np.full((1, tab.shape[2]), INF), diag.min(axis=0)])
        by_seg[seg].append(_Table(w, tab, diag, shortest))
    if len(_TABLES) >= 2:  # one problem is solved at a time: keep its tables, not old ones
        _TABLES.clear()
        _SHORTEST.clear()
    _TABLES[id(p)] = (p, by_seg)
    flat = [t.shortest for tabs in by_seg for t in tabs]
    _SHORTEST[id(p)] = np.stack(flat) if flat else np.zeros((0, num_units + 1, p.max_stages + 1))
    return by_seg


_TABLES: dict[int, tuple[StageProblem, list[list[_Table]]]] = {}
_SHORTEST: dict[int, np.ndarray] = {}  # per problem, every table's ``shortest`` stacked in _tables' order


def _bands(p: StageProblem, by_seg: list[list[_Table]], t_max: float) -> list[list[list[int]]]:
    """Per segment, per table, per stage count ``s``: the most units of a stage that fits under
    ``t_max`` (0: none), i.e. ``max(d : shortest[d, s] <= t_max)``; one numpy pass for all tables."""
    short = _SHORTEST[id(p)]
    lengths = np.arange(short.shape[1])[None, :, None]
    flat = np.where(short <= t_max, lengths, 0).max(axis=1).tolist()  # [tables, S + 1]
    out, at = [], 0
    for tabs in by_seg:
        out.append(flat[at : at + len(tabs)])
        at += len(tabs)
    return out


_MIN = np.minimum.reduce  # ndarray.min without its Python wrapper (the same floats)


def _masked(x: np.ndarray, t_max: float) -> np.ndarray:
    return x if t_max == INF else np.where(x <= t_max, x, INF)


PREMASK_MAX = 1 << 16  # tables up to this many entries are masked by t_max whole, once per run


class _Premask:
    """``tab`` and ``diag`` of one table for :func:`_run`: a small table masked by ``t_max`` whole (one
    ``np.where`` instead of one per stage count ``s``; its slices then need no mask, ``mask_at`` INF),
    each array on its first read (a table no band reaches is never masked); a large one is masked
    slice by slice where read (a narrow band reads a few columns). Same floats either way."""

    def __init__(self, t: _Table, t_max: float) -> None:
        self.t, self.t_max = t, t_max
        whole = t_max != INF and t.tab.size <= PREMASK_MAX
        self.mask_at = INF if whole else t_max  # what _run still masks slice by slice
        self._tab: np.ndarray | None = None if whole else t.tab
        self._diag: np.ndarray | None = None if whole else t.diag

    def tab(self) -> np.ndarray:
        if self._tab is None:
            self._tab = _masked(self.t.tab, self.t_max)
        return self._tab

    def diag(self) -> np.ndarray:
        if self._diag is None:
            self._diag = _masked(self.t.diag, self.t_max)
        return self._diag


def _run(p: StageProblem, t_max: float, chain: float = 0.0, lead: float = 1.0) -> list[np.ndarray]:
    """Fill ``G[i]`` (shape ``[S + 1, U + 1, cap_i + 1]``) for bound ``t_max``.

    ``chain`` (``m``, rule R6's :func:`chain_floor`): the first stage ``t`` of a suffix whose value is
    ``V`` gives ``max(m t, lead t + V)`` instead of ``t + V``.

    Only entries that can be finite are computed, so every minimum is over the same finite floats
    as the full product (the plan is unchanged): ``s`` stages left need ``s`` units, so a stage
    ``[k, j)`` with ``s`` left has ``k <= U - s`` and ``j <= U - s + 1``; and a stage longer than
    the longest one that fits under ``t_max`` (its *band*, per table and ``s``) is inf, so the
    min-plus product runs over ``j - k <= band`` only (``t_max`` small: a few units per stage).
    And ``s`` stages take at most ``s`` times a segment's widest option in slots, so only the slot
    columns up to that many are priced; the ones past it are a copy (the same candidates).
    """
    num_units, max_stages = p.num_units, p.max_stages
    nseg = len(p.capacities)
    # rows past U stay inf: the padding a narrow band's window reads past the last unit (a view, below)
    pad = num_units // 2 + 1  # a narrow band is under half of the U - s + 1 <= U first units
    g = [np.full((max_stages + 1, num_units + 1 + pad, cap + 1), INF) for cap in p.capacities]
    for i in range(nseg):
        g[i][0, num_units, :] = 0.0
    by_seg = _tables(p)
    # band[s]: the most units of a stage that fits under t_max with s stages left (0: none), capped at
    # the U - s + 1 first units there are, per table; narrow[s]: the widest band under half of those.
    # (large tables are masked by t_max slice by slice, where read: a narrow band reads a few columns;
    # small ones whole, once per run, on first read: _Premask)
    nks = num_units + 1 - np.arange(max_stages + 1)  # U - s + 1 per s
    # most slots s stages can take in segment i: past them every column of G[i][s] equals that one
    # (each candidate there is the same float: every width fits and leaves as many slots as it needs)
    most = [max((t.width for t in tabs), default=0) for tabs in by_seg]
    segs: list[tuple[list[tuple[_Table, _Premask]], list[list[int]], list[int]]] = []
    for seg_tables, seg_bands in zip(by_seg, _bands(p, by_seg, t_max)):
        if not seg_tables:
            segs.append(([], [[]] * (max_stages + 1), [0] * (max_stages + 1)))
            continue
        wid = np.minimum(np.array(seg_bands, dtype=np.int64), nks[None, :])  # [tables, S + 1]
        narrow = np.where(2 * wid < nks[None, :], wid, 0).max(axis=0)
        segs.append(([(t, _Premask(t, t_max)) for t in seg_tables], wid.T.tolist(), narrow.tolist()))
    for s in range(1, min(max_stages, num_units) + 1):
        nk = num_units - s + 1
        for i in reversed(range(nseg)):
            cur = g[i][s]
            if i + 1 < nseg:
                cur[:nk, :] = g[i + 1][s][:nk, p.capacities[i + 1], None]
            cap = p.capacities[i]
            lim = min(cap, s * most[i])  # columns past lim: a copy of column lim (filled below)
            tabs, widths, narrows = segs[i]
            prev = g[i][s - 1]
            if narrows[s]:  # win[k, d, c] = G[s - 1][k + 1 + d, c] (inf past the last unit: the padding), a view
                r, col = prev.strides
                win = np.ndarray((nk, narrows[s], cap + 1), prev.dtype, prev, r, (r, r, col))
            for (t, pm), width in zip(tabs, widths[s]):
                w = t.width
                if width == 0:
                    continue
                if 2 * width >= nk:  # wide band: the square corner is as cheap
                    c = _masked(pm.tab()[:nk, : nk + 1, s], pm.mask_at)  # [U - s + 1, U - s + 2]
                    x = c[:, :, None]
                    cand = (x if lead == 1.0 else lead * x) + prev[None, : nk + 1, : lim + 1 - w]
                    if chain:
                        np.maximum(cand, chain * x, out=cand)
                    cand = _MIN(cand, axis=1)
                else:  # cand[k] = min_d diag[k, d] + G[s - 1][k + 1 + d]
                    d = pm.diag()[:nk, :width, s]
                    if pm.mask_at != INF:
                        d = np.where(d <= pm.mask_at, d, INF)
                    x = d[:, :, None]
                    cand = (x if lead == 1.0 else lead * x) + win[:, :width, : lim + 1 - w]
                    if chain:
                        np.maximum(cand, chain * x, out=cand)
                    cand = _MIN(cand, axis=1)  # [U - s + 1, lim + 1 - w]
                np.minimum(cur[:nk, w : lim + 1], cand, out=cur[:nk, w : lim + 1])
            if lim < cap:
                cur[:nk, lim + 1 :] = cur[:nk, lim, None]
    return [x[:, : num_units + 1] for x in g]  # without the padding


def _best_stages(p: StageProblem, g: list[np.ndarray]) -> tuple[float, int]:
    col = g[0][:, 0, p.capacities[0]]
    s = int(np.argmin(col))
    return float(col[s]), s


def _reconstruct(p: StageProblem, g: list[np.ndarray], t_max: float, s: int) -> list[tuple[int, int, int]]:
    out: list[tuple[int, int, int]] = []
    i, k, c = 0, 0, p.capacities[0]
    while s > 0:
        val = g[i][s][k, c]
        if i + 1 < len(p.capacities) and val == g[i + 1][s][k, p.capacities[i + 1]]:
            i, c = i + 1, p.capacities[i + 1]
            continue
        found = None
        for o, seg in enumerate(p.option_segment):
            w = p.option_width[o]
            if seg != i or w > c:
                continue
            row = p.times[o, k, :, s]
            for j in range(k + 1, p.num_units + 1):
                t = row[j]
                if t <= t_max and math.isfinite(t) and t + g[i][s - 1][j, c - w] == val:
                    found = (o, j, w)
                    break
            if found:
                break
        if found is None:  # cannot happen: every finite G entry has a witness
            raise RuntimeError(f"DP reconstruction failed at segment {i}, stage {s}, unit {k}")
        o, j, w = found
        out.append((k, j, o))
        k, c, s = j, c - w, s - 1
    return out


def _thin(values: np.ndarray, epsilon: float) -> list[float]:
    """Group sorted values within ``(1 + epsilon)`` of a group's first and keep each group's largest."""
    if epsilon == 0:
        return [float(v) for v in values]
    kept: list[float] = []
    first = None
    for v in values:
        if first is None or v > first * (1.0 + epsilon):
            first = float(v)
            kept.append(first)
        else:
            kept[-1] = float(v)
    return kept


def _times_below(p: StageProblem, t_limit: float) -> np.ndarray:
    """The finite stage times of ``p`` no larger than ``t_limit`` (the ``t_max`` candidates)."""
    finite = p.times[np.isfinite(p.times)]
    return finite if t_limit == INF else finite[finite <= t_limit]


def fits_under(p: StageProblem, t_limit: float, stats: DPStats | None = None) -> bool:
    """Does any stage sequence of ``p`` fit with every stage taking at most ``t_limit``? One DP run."""
    if stats is not None:
        stats.dp_runs += 1
    return math.isfinite(_best_stages(p, _run(p, t_limit))[0])


def chain_floor(
    p: StageProblem, m: int, t_limit: float = INF, stats: DPStats | None = None, lead: float = 1.0
) -> float:
    """Rule R6: the least, over the stage sequences of ``p`` that fit with every stage at most
    ``t_limit``, of ``max_r (lead (t_0 + ... + t_{r-1}) + m t_r)`` (inf when none fits); one DP run.

    Rank ``r`` cannot start before the first micro-batch has crossed the stages before it and then
    runs ``m`` periods of work; ``lead`` is the share of a period that crossing costs at least
    (``planner._lead``). Under 1F1B and GPipe (F, and B with W, one action each, a stage per rank)
    the last backward of rank ``r`` has to cross them back too: ``lead = 1``. The simulated step is
    at least that for every ``r`` (``pipeline_sim``; tested against it). The DP's closed form
    ``sum + (m - 1) max`` is no bound (a slowest stage first simulates below it)."""
    if stats is not None:
        stats.dp_runs += 1
    return _best_stages(p, _run(p, t_limit, chain=float(m), lead=lead))[0]


def solve_stages(
    p: StageProblem,
    *,
    epsilon: float = 0.0,
    stats: DPStats | None = None,
    upper: float = INF,
    t_limit: float = INF,
) -> StageSolution | None:
    """Best stage sequence for ``p`` among those whose stages all take at most ``t_limit`` (None when
    none fits, or none has an objective below ``upper``, which R1 then uses as its first cut). See
    the module docstring; ``t_limit`` is rule R6's (``step_bounds.t_limit``)."""
    st = stats if stats is not None else DPStats()
    finite = _times_below(p, t_limit)
    st.stage_candidates += int(finite.size)
    if finite.size == 0:
        return None
    cands = np.unique(finite)
    st.t_max_candidates += int(cands.size)
    thinned = _thin(cands, epsilon)
    st.t_max_thinned += int(cands.size) - len(thinned)

    def run(t: float) -> tuple[float, int, list[np.ndarray]]:
        st.dp_runs += 1
        g = _run(p, t)
        val, s = _best_stages(p, g)
        return val, s, g

    # R8: branch and bound over the t_max candidates. G(t), the least stage-time sum with every
    # stage <= t, is non-increasing in t, so on candidates [a, b] the objective is at least
    # alpha * G(t_b) + beta * t_a: an interval whose bound cannot beat the best is dropped whole
    # (R1 is this bound with G(t_b) = sum_inf). Intervals are split at their middle candidate, left
    # first; ties keep the smallest t_max, as the ascending scan did, so the answer is the scan's.
    evaluated: dict[int, tuple[float, StageSolution | None]] = {}

    def at(idx: int) -> float:
        if idx not in evaluated:
            t = thinned[idx]
            st.t_max_tried += 1
            val, s, g = run(t)
            sol = None
            if math.isfinite(val):
                stages = _reconstruct(p, g, t, s)
                times = tuple(float(p.times[o, k, j, len(stages) - n]) for n, (k, j, o) in enumerate(stages))
                sol = StageSolution(tuple(stages), times, p.alpha * sum(times) + p.beta * max(times))
            evaluated[idx] = (val, sol)
        return evaluated[idx][0]

    best: list[tuple[float, int, StageSolution] | None] = [None]

    def consider(idx: int) -> None:
        sol = evaluated[idx][1]
        if sol is None or sol.objective >= upper:
            return
        cur = best[0]
        better = cur is None or (
            sol.objective < cur[0] - 1e-12 * abs(sol.objective)
            if idx > cur[1]
            else sol.objective <= cur[0] + 1e-12 * abs(cur[0])
        )
        if better:
            best[0] = (sol.objective, idx, sol)

    def cutoff(lo_idx: int) -> float:
        cur = best[0]
        if cur is None:
            return upper
        return cur[0] * (1 + 1e-12) if lo_idx < cur[1] else cur[0]

    last = len(thinned) - 1
    sum_inf = at(last)  # the largest candidate admits every stage: the unconstrained sum
    if not math.isfinite(sum_inf) or p.alpha * sum_inf + p.beta * thinned[0] >= upper:
        return None
    stack = [(0, last)]
    while stack:
        lo, hi = stack.pop()
        g_hi = at(hi)
        consider(hi)
        if not math.isfinite(g_hi):  # nothing fits below t_hi: nothing below either
            st.t_max_cut += hi - lo
            continue
        if lo == hi:
            continue
        if p.alpha * g_hi + p.beta * thinned[lo] >= cutoff(lo):
            st.t_max_cut += hi - lo
            continue
        at(lo)
        consider(lo)
        if hi - lo == 1:
            continue
        mid = (lo + hi) // 2
        stack.append((mid, hi))
        stack.append((lo, mid))
    return None if best[0] is None else best[0][2]


def scan_stages(
    p: StageProblem,
    *,
    epsilon: float = 0.0,
    stats: DPStats | None = None,
    upper: float = INF,
    t_limit: float = INF,
) -> StageSolution | None:
    """The ascending ``t_max`` scan with bisection and rule R1 only (the algorithm before R8), kept
    as the reference :func:`solve_stages` must equal (``tests/search/test_inter_op.py``)."""
    st = stats if stats is not None else DPStats()
    finite = _times_below(p, t_limit)
    if finite.size == 0:
        return None
    thinned = _thin(np.unique(finite), epsilon)
    st.dp_runs += 1
    sum_inf, _ = _best_stages(p, _run(p, t_limit))
    if not math.isfinite(sum_inf) or p.alpha * sum_inf + p.beta * thinned[0] >= upper:
        return None
    lo, hi = 0, len(thinned) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        st.dp_runs += 1
        if math.isfinite(_best_stages(p, _run(p, thinned[mid]))[0]):
            hi = mid
        else:
            lo = mid + 1
    best: StageSolution | None = None
    for idx in range(lo, len(thinned)):
        t = thinned[idx]
        if p.alpha * sum_inf + p.beta * t >= (best.objective if best is not None else upper):
            break
        st.dp_runs += 1
        g = _run(p, t)
        val, s = _best_stages(p, g)
        if not math.isfinite(val):
            continue
        stages = _reconstruct(p, g, t, s)
        times = tuple(float(p.times[o, k, j, len(stages) - n]) for n, (k, j, o) in enumerate(stages))
        obj = p.alpha * sum(times) + p.beta * max(times)
        if obj < upper and (best is None or obj < best.objective - 1e-12 * abs(obj)):
            best = StageSolution(tuple(stages), times, obj)
    return best


def brute_force_stages(
    p: StageProblem, objective: Callable[[tuple[float, ...]], float] | None = None
) -> StageSolution | None:
    """Exhaustive reference for tests: every split, option and segment order allowed by ``p``, the
    least ``objective`` of the stage times (default ``alpha * sum + beta * max``)."""
    best: list[StageSolution | None] = [None]
    num_units = p.num_units

    def rec(k: int, seg: int, left: list[int], acc: list[tuple[int, int, int]]) -> None:
        if k == num_units:
            n = len(acc)
            times = tuple(float(p.times[o, a, b, n - i]) for i, (a, b, o) in enumerate(acc))
            if not all(math.isfinite(t) for t in times):
                return
            obj = p.alpha * sum(times) + p.beta * max(times) if objective is None else objective(times)
            if best[0] is None or obj < best[0].objective:
                best[0] = StageSolution(tuple(acc), times, obj)
            return
        if len(acc) >= p.max_stages:
            return
        for o, sg in enumerate(p.option_segment):
            w = p.option_width[o]
            if sg < seg or w > left[sg]:
                continue
            for j in range(k + 1, num_units + 1):
                left[sg] -= w
                rec(j, sg, left, [*acc, (k, j, o)])
                left[sg] += w

    rec(0, 0, list(p.capacities), [])
    return best[0]


def stage_problem(
    times: np.ndarray,
    option_segment: Sequence[int],
    option_width: Sequence[int],
    capacities: Sequence[int],
    alpha: float,
    beta: float,
) -> StageProblem:
    arr = np.asarray(times, dtype=np.float64)
    # R10 (exact): a segment holds at most S stages of at most its widest option. Where its
    # capacity admits that many (a 512-GPU type at dp = 1), the slots never bind: the segment's
    # widths and capacity become 0, so its DP has one slot column instead of hundreds; every state
    # the reconstruction visits from a full segment had slots to spare, so the plan is the same.
    max_stages = arr.shape[3] - 1
    widths, caps = list(option_width), list(capacities)
    for i, cap in enumerate(capacities):
        mine = [o for o, sg in enumerate(option_segment) if sg == i]
        if mine and cap >= max_stages * max(option_width[o] for o in mine):
            caps[i] = 0
            for o in mine:
                widths[o] = 0
    return StageProblem(arr, tuple(option_segment), tuple(widths), tuple(caps), alpha, beta)
