"""Rule R6: lower bounds on a candidate's simulated step, and the bars the planner skips work against.

Called by ``search/entry/planner.py`` (its outer loop and ``Search.solve_config``) and
``search/pipeline/zero_bubble.py``; reads a ``planner.Search`` it is handed (unit tables, stage options) and
runs ``inter_op``'s DP. A candidate's step is its simulated pipeline plus its largest tail
(``plan_build.Candidate``), and the DP's closed form ``sum + (m - 1) max`` does not bound the
simulated pipeline (a slowest stage first simulates below it, by up to 22% on random 1F1B stages;
ZB-H1 always does). What does:

* :func:`floor`: a rank runs its ``m`` micro-batches' actions one after another, so the step is at
  least ``m`` times the slowest period; :func:`t_limit` turns a bar into the slowest period a
  candidate may have (``inter_op.solve_stages``' ``t_limit``);
* :func:`chains` and ``inter_op.chain_floor``: a rank also waits for the first micro-batch to cross
  the stages before it, and (1F1B, GPipe, interleaved) for its last backward to cross them back;
* :func:`time_floor`: the chain bound from the unit tables alone, before any stage array is built;
  :func:`can_beat`: the same with the arrays, for zero-bubble configurations priced at counts no
  larger than any depth's;
* :func:`area_floor`: not a cut, the order configurations are visited in.

``tests/search/test_search_bounds.py`` checks every bound against the simulator and against the
search with no cut.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from partita.search.pipeline import schedule as sched
from partita.search.pipeline import schedule_cost
from partita.search.pipeline.inter_op import chain_floor, fits_under, stage_problem
from partita.search.pipeline.stage_cost import UnitTable


def tail_bound(fam: list[Any]) -> float:
    """A lower bound on any pipeline's largest stage tail: its first stage starts at unit 0 and its
    last one ends at unit U, on some option and combo that fits (rule R7)."""
    first, last = math.inf, math.inf
    for o in fam:
        # fits with some number of stages after it: the first row and the last column of [C, U, U+1]
        fit_first = np.isfinite(o.stack[:, 0]).any(axis=2)
        fit_last = np.isfinite(o.stack[:, :, -1]).any(axis=2)
        first = min(first, float(np.min(o.tails[:, 0][fit_first], initial=math.inf)))
        last = min(last, float(np.min(o.tails[:, :, -1][fit_last], initial=math.inf)))
    bound = max(first, last)
    return bound if math.isfinite(bound) else 0.0


def least_time(tab: UnitTable) -> np.ndarray:
    """``[U, U + 1]``: the least period any ZeRO / recompute combo of a range can take on one table
    (forward plus backward of either precision's table; inf where ``k >= j``), :func:`time_floor`."""
    t = tab.ranged("fwd") + tab.ranged("bwd")
    if tab.alt is not None:
        t = np.minimum(t, tab.alt.ranged("fwd") + tab.alt.ranged("bwd"))
    return np.where(tab.ranged("num_layers") > 0, t, np.inf)


def families(opts: list[Any]) -> list[list[Any]]:
    """The options solved apart: the pure ones, and the mixed (Cephalo) ones where any."""
    mixed_segs = {o.segment for o in opts if len(o.devices) > 1}
    families = [[o for o in opts if o.segment not in mixed_segs]]
    if mixed_segs:
        families.append([o for o in opts if o.segment in mixed_segs])
    return [f for f in families if f]


def problem(fam: list[Any], times: list[np.ndarray], caps: list[int], alpha: float, beta: float) -> Any:
    """The stage DP's problem of a family, with ``times`` per option, its segments renumbered."""
    segs = sorted({o.segment for o in fam})
    remap = {s: i for i, s in enumerate(segs)}
    return stage_problem(
        np.stack(times), [remap[o.segment] for o in fam], [o.width for o in fam], [caps[s] for s in segs], alpha, beta
    )


BOUND_SLACK = 1e-9  # relative: a rank's simulated busy time sums its F, B and W, split from t with rounding


def floor(m: int, t: float, tail: float) -> float:
    """Rule R6: a lower bound on the step of any candidate whose slowest stage takes ``t`` per
    micro-batch and whose largest tail is at least ``tail``. The simulated pipeline
    (``schedule_cost.pipeline_time``) runs each rank's actions one after another, and a rank runs ``m``
    micro-batches of F, B and W that add up to its period (``v`` chunks of ``t / v`` interleaved), so
    the step is at least ``m t`` plus the tail, whatever the schedule."""
    return m * t * (1.0 - BOUND_SLACK) + tail


def t_limit(m: int, tail: float, bar: float) -> float:
    """Rule R6: the largest stage time a candidate can have and still reach ``bar`` (a tie is kept:
    the plan's pick breaks ties by its summary), :func:`floor` solved for ``t``; inf for no bar."""
    return math.inf if not math.isfinite(bar) else (bar - tail) / (m * (1.0 - BOUND_SLACK))


def area_floor(s: Any, dp: int, b: int) -> float:
    """The order rule R6 visits configurations in (the likeliest first, so that their bests cut the
    rest early): a bound on ``sum t + (m - 1) max t`` from the pure device types' unit tables, without
    memory. The sum is at least each unit's fastest time summed; the slowest stage takes at least the
    work spread over the slots (an LP dual: unit ``u`` on type ``d`` costs ``w t`` slot-seconds,
    each type's slots weighed by the inverse of the work the whole model costs on it)."""
    m = s.training.global_batch // (b * dp)
    segs = []
    for d in s.types:
        cap = s.cluster.count(d.name) // dp
        if cap < 1:
            continue
        opts = []
        for tp in s.tps(d):
            tab = s.table(d, tp, b) if tp <= cap else None
            if tab is None:
                continue
            ut = tab.fwd + tab.bwd
            if tab.alt is not None:
                ut = np.minimum(ut, tab.alt.fwd + tab.alt.bwd)
            opts.append((tp, ut))
        if opts:
            segs.append((cap, opts))
    if not segs:
        return math.inf
    allut = np.array([ut for _, opts in segs for _, ut in opts])
    s_lb = allut.min(axis=0).sum()
    areas = [np.min([w * ut for w, ut in opts], axis=0) for cap, opts in segs]
    tot = [a.sum() for a in areas]
    denom = sum(cap / at for (cap, _), at in zip(segs, tot))
    t_lb = np.min([a / (at * denom) for a, at in zip(areas, tot)], axis=0).sum()
    return float(s_lb + (m - 1) * t_lb)


def chains(search: Any, dp: int, b: int, schedule: str, v: int = 1) -> list[tuple[float, float]]:
    """``(lead, scale)`` pairs: the step of a configuration's candidate is at least ``scale`` times
    ``inter_op.chain_floor`` with ``lead``, for each. A rank starts once the first micro-batch has
    crossed the stages before it and then runs ``m`` periods; under 1F1B and GPipe (F, and B with
    W, per micro-batch) its last backward crosses them back too: ``(1, 1)``; interleaved, each
    crossing is one chunk, ``1 / v`` of a period: ``(1 / v, 1)``. A split backward leaves W out of
    the crossings: the forwards alone, at least a share ``rho`` of a period, ``(rho / v, 1)``; and
    F and B, at least ``1 - omega`` of every period, its last B's crossing back included,
    ``(1, 1 - omega)`` (``schedule_cost.action_shares``, at every micro-batch size this
    configuration runs)."""
    vv = sched.virtual_stages(schedule, v)
    if not sched.splits_backward(schedule):
        return [(1.0 / vv, 1.0)]
    shares = _shares_of(search)
    if shares is None:  # FLOPs not affine in the micro-batch: at each size this configuration runs
        sizes = sorted({b} | {x for cls in search.mixes(dp, b) for _, _, x in cls})
        got = [schedule_cost.action_shares(_flops(search, x)) for x in sizes]
        shares = (min(r for r, _ in got), max(w for _, w in got))
    rho, omega = shares
    return [(rho / vv, 1.0)] + ([(1.0, 1.0 - omega)] if vv == 1 else [])


def _shares(search: Any) -> tuple[float, float] | None:
    """``schedule_cost.action_shares`` at every micro-batch size at once, where each layer's FLOPs
    are affine in it (checked at 1, 2 and 3, float for float): a layer's shares are then monotone
    in the size, so their extremes are at 1 or in the limit. None where they are not. Once per search."""
    if search.costs.linear_batch:
        return schedule_cost.action_shares(_flops(search, 1))
    rows = [_flops(search, x) for x in (1, 2, 3)]
    limits = []
    for r1, r2, r3 in zip(*rows):
        if any(c - b != b - a for a, b, c in zip(r1, r2, r3)):
            return None
        limits.append(tuple(b - a for a, b in zip(r1, r2)))
    return schedule_cost.action_shares([*rows[0], *limits])


def chain_bound(search: Any, p: Any, m: int, limit: float, pairs: list[tuple[float, float]]) -> float:
    """The largest of :func:`chains`' bounds ``pairs`` on ``p`` (each with :func:`floor`'s slack)."""
    return max(floor(1, scale * chain_floor(p, m, limit, search.stats, lead), 0.0) for lead, scale in pairs)


def time_floor(search: Any, dp: int, b: int, schedule: str, v: int = 1, bar: float = math.inf) -> float:
    """Rule R6 before any stage option is priced: a lower bound on the step of every candidate of a
    configuration, from the unit tables alone (every option and class, memory ignored, each range
    at the least time any combo can take: forward plus backward without recompute, no exposed
    traffic, no p2p, max over a class's types): :func:`inter_op.chain_floor` per family, the
    least. Cheap (the tables' range sums and one DP run), so a configuration that cannot beat the
    best is dropped before its arrays are built. Stage sequences with a stage too slow to reach
    ``bar`` (:func:`t_limit`) are left out: inf where only such sequences are left."""
    m = search.training.global_batch // (b * dp)
    pairs = chains(search, dp, b, schedule, v)
    max_stages = search.max_stages(dp)
    fams: dict[bool, tuple[list[np.ndarray], list[int], list[int], list[int]]] = {}
    for cls, cap in search.classes(dp, b):
        times, segs, widths, caps = fams.setdefault(len(cls) > 1, ([], [], [], []))
        seg = len(caps)
        caps.append(cap)
        for tp in sorted(set.intersection(*[set(search.tps(d)) for d, _, _ in cls])):
            got = [search.table(d, tp, share) for d, _, share in cls] if tp <= cap else [None]
            tabs = [x for x in got if x is not None]
            if len(tabs) < len(got):
                continue
            t = np.max([least_time(x) for x in tabs], axis=0)
            times.append(np.broadcast_to(t[:, :, None], (*t.shape, max_stages + 1)))
            segs.append(seg)
            widths.append(tp)
    out = math.inf
    for times, segs, widths, caps in fams.values():
        if times:
            p = stage_problem(np.stack(times), segs, widths, caps, 1.0, m - 1.0)
            out = min(out, chain_bound(search, p, m, t_limit(m, 0.0, bar), pairs))
    return out


def can_beat(search: Any, dp: int, b: int, schedule: str, v: int, bar: float) -> bool:
    """Rule R6: can a candidate of one outer configuration, priced with the in-flight counts in
    force (``Search.pricing_in_flight``), fit and reach a step of ``bar``? Counts no larger than any
    the search prices it with answer for those too (memory grows with the count). Per family, one
    DP run: does a stage sequence fit under :func:`t_limit`?"""
    m = search.training.global_batch // (b * dp)
    opts, caps, _ = search.options_for(dp, b, m, schedule, v)
    alpha, beta = sched.coefficients(schedule, m, v)
    for fam in families(opts):
        p = problem(fam, [o.best for o in fam], caps, alpha, beta)
        if fits_under(p, t_limit(m, tail_bound(fam), bar), search.stats):
            return True
    return False


def _flops(search: Any, size: int) -> Any:
    return schedule_cost.layer_flops(search.graph, {"B": size, "S": search.training.seq_len})


def _shares_of(search: Any) -> tuple[float, float] | None:
    """:func:`_shares`, kept on the search (it reads the IR's FLOPs three times)."""
    if "_step_shares" not in search.__dict__:
        search.__dict__["_step_shares"] = _shares(search)
    return search.__dict__["_step_shares"]
