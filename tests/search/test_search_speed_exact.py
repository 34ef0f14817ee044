"""Issue 20, second pass: each fast path of the search against the plain computation it replaced
(in-process, about a second): the simulator's dependency table built from ``(stage, micro, kind)``
tuples, one rank's in-flight peak, the DP's bands in one numpy pass, and rule R7's tail bound read
from the first row and the last column only. The plans themselves are compared byte for byte by
``bench/search_speed.py`` (``exact_small``) and ``tests/search/test_planner.py``."""

from __future__ import annotations

import math

import numpy as np
import pytest

from partita.errors import ConfigError
from partita.search.entry.planner import Option
from partita.search.pipeline import inter_op, pipeline_sim
from partita.search.pipeline import schedule as sched
from partita.search.pipeline.step_bounds import tail_bound

SHAPES = [
    (schedule, p, m, v)
    for schedule in ("gpipe", "1f1b", "zb_h1", "interleaved_1f1b", "zbv")
    for p in (1, 2, 3, 4, 6)
    for m in (1, 2, 3, 4, 6, 8, 12)
    for v in ((1, 2, 3) if schedule == "interleaved_1f1b" else (1,))
]


def _lists(schedule: str, p: int, m: int, v: int) -> list[list[sched.Action]] | None:
    try:
        return sched.pipeline_actions(schedule, p, m, sched.virtual_stages(schedule, v))
    except ConfigError:
        return None


def _reference_table(schedule: str, lists: list[list[sched.Action]], p: int, v: int) -> tuple[tuple[int, ...], ...]:
    """The dependency table as first written: retire each rank's actions in list order while their
    inputs exist, one dependency list per action (pipeline_sim._compile's columns)."""
    n_st = p * v
    home = [sched.stage_rank(schedule, s, p, v) for s in range(n_st)]
    index: dict[tuple[int, int, str], int] = {}
    cols: list[list[int]] = [[] for _ in range(9)]
    pos, last = [0] * p, [-1] * p
    remaining = sum(len(x) for x in lists)
    while remaining:
        for r in range(p):
            while pos[r] < len(lists[r]):
                a = lists[r][pos[r]]
                s, mb = a.stage, a.micro
                if a.kind == "F":
                    deps = [(s - 1, mb, "F", s - 1)] if s > 0 else []
                elif a.kind == "B":
                    deps = [(s, mb, "F", -1)] + ([(s + 1, mb, "B", s)] if s + 1 < n_st else [])
                else:
                    deps = [(s, mb, "B", -1)]
                if any(d[:3] not in index for d in deps):
                    break
                edges = [(index[d[:3]], d[3] if d[3] >= 0 and home[d[3]] != home[d[3] + 1] else -1) for d in deps]
                edges += [(-1, -1)] * (2 - len(edges))
                row = (s, "FBW".index(a.kind), last[r], *edges[0], *edges[1], r, mb)
                for col, x in zip(cols, row, strict=True):
                    col.append(x)
                index[(s, mb, a.kind)] = last[r] = len(cols[0]) - 1
                pos[r] += 1
                remaining -= 1
    return tuple(tuple(c) for c in cols)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb_h1", "interleaved_1f1b", "zbv"])
def test_rank_orders_and_table_equal_the_action_lists(schedule: str) -> None:
    for name, p, m, v in SHAPES:
        if name != schedule or (lists := _lists(name, p, m, v)) is None:
            continue
        vv = sched.virtual_stages(name, v)
        orders = sched.rank_orders(name, p, m, vv)
        assert orders == [[(a.stage, a.micro, a.kind) for a in acts] for acts in lists]
        assert pipeline_sim._dag(name, p, m, v) == _reference_table(name, lists, p, vv)


@pytest.mark.parametrize("w_held", [1.0, 1.5, 2.0])
def test_one_rank_peak_equals_counting_its_list(w_held: float) -> None:
    for name, p, m, v in SHAPES:
        if (lists := _lists(name, p, m, v)) is None:
            continue
        split = sched.splits_backward(name)
        vv = sched.virtual_stages(name, v)
        want = []
        for acts in lists:  # the plain count: forwards held, deferred W's weighted by w_held
            fwd = deferred = 0
            peak = 0.0
            for a in acts:
                fwd += {"F": 1, "B": -1}.get(a.kind, 0)
                deferred += {"B": int(split), "W": -1}.get(a.kind, 0)
                peak = max(peak, fwd + w_held * deferred)
            want.append(peak / vv)
        assert sched.peak_in_flight(name, p, m, v, w_held) == tuple(want)
        for r in range(p):
            assert sched.rank_peak_in_flight(name, r, p, m, v, w_held) == want[r]
            if name == "interleaved_1f1b" and w_held == 1.0:  # the planner's count of position r
                assert sched.in_flight(name, r, p, m, v) == want[r]


@pytest.mark.parametrize("seed", range(4))
def test_bands_equal_per_table(seed: int) -> None:
    rng = np.random.default_rng(seed)
    units, depth = 8, 6
    times = rng.integers(1, 7, (5, units, units + 1, depth)).astype(float)
    times[rng.random(times.shape) < 0.3] = np.inf
    p = inter_op.stage_problem(times, [0, 0, 1, 1, 2], [1, 2, 1, 2, 1], [4, 3, 9], 2.0, 1.0)
    by_seg = inter_op._tables(p)
    lengths = np.arange(units + 1)[:, None]
    for t_max in [math.inf, *np.unique(times[np.isfinite(times)])]:
        got = inter_op._bands(p, by_seg, float(t_max))
        want = [[np.where(t.shortest <= t_max, lengths, 0).max(axis=0).tolist() for t in tabs] for tabs in by_seg]
        assert got == want


def _reference_tail_bound(fam: list[Option]) -> float:
    first, last = math.inf, math.inf
    for o in fam:
        fit = np.isfinite(o.stack).any(axis=3)
        first = min(first, float(np.min(o.tails[:, 0][fit[:, 0]], initial=math.inf)))
        last = min(last, float(np.min(o.tails[:, :, -1][fit[:, :, -1]], initial=math.inf)))
    bound = max(first, last)
    return bound if math.isfinite(bound) else 0.0


@pytest.mark.parametrize("seed", range(6))
def test_tail_bound(seed: int) -> None:
    from types import SimpleNamespace

    rng = np.random.default_rng(seed)
    fam = []
    for _ in range(3):
        combos, units, depth = 4, 6, 5
        stack = rng.integers(0, 5, (combos, units, units + 1, depth)).astype(float)
        stack[rng.random(stack.shape) < 0.5 + 0.1 * seed] = np.inf
        arrays = [SimpleNamespace(tail=rng.random((units, units + 1))) for _ in range(combos)]
        fam.append(Option(0, 1, 1, (), (), arrays, [(0, "none")] * combos, stack))
    assert tail_bound(fam) == _reference_tail_bound(fam)
