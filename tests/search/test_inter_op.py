"""The stage DP against exhaustive search on random synthetic cost tables."""

from __future__ import annotations

import numpy as np
import pytest

from partita.search.pipeline.inter_op import (
    DPStats,
    StageProblem,
    brute_force_stages,
    scan_stages,
    solve_stages,
    stage_problem,
)


def _random_problem(rng: np.random.Generator) -> object:
    num_units = int(rng.integers(1, 7))
    nseg = int(rng.integers(1, 3))
    caps = [int(rng.integers(1, 5)) for _ in range(nseg)]
    opts = [(sg, w) for sg in range(nseg) for w in (1, 2)]
    speed = rng.uniform(0.5, 2.0, size=(len(opts), num_units))
    times = np.full((len(opts), num_units, num_units + 1, num_units + 1), np.inf)
    budget = rng.uniform(2, 6)
    for o, (_sg, w) in enumerate(opts):
        for k in range(num_units):
            for j in range(k + 1, num_units + 1):
                for s in range(1, num_units + 1):
                    if (j - k) * s / w <= budget:  # in-flight activations grow with stages left
                        times[o, k, j, s] = speed[o, k:j].sum() / w**0.8 + 0.1
    m = int(rng.integers(1, 9))
    return stage_problem(times, [o[0] for o in opts], [o[1] for o in opts], caps, 1.0, m - 1.0)


@pytest.mark.parametrize("seed", range(4))
def test_dp_equals_brute_force(seed: int) -> None:
    rng = np.random.default_rng(seed)
    for _ in range(40):
        p = _random_problem(rng)
        got, ref = solve_stages(p, epsilon=0.0), brute_force_stages(p)
        assert (got is None) == (ref is None)
        if ref is not None:
            assert got.objective == pytest.approx(ref.objective, rel=1e-12)
            # the reported stages really cover the units in order and respect capacities
            assert got.stages[0][0] == 0 and got.stages[-1][1] == p.num_units
            assert all(a[1] == b[0] for a, b in zip(got.stages, got.stages[1:]))
            used = [0] * len(p.capacities)
            for _k, _j, o in got.stages:
                used[p.option_segment[o]] += p.option_width[o]
            assert all(u <= c for u, c in zip(used, p.capacities))


def test_thinning_is_within_epsilon_and_counts() -> None:
    rng = np.random.default_rng(7)
    for _ in range(20):
        p = _random_problem(rng)
        ref = brute_force_stages(p)
        st = DPStats()
        got = solve_stages(p, epsilon=0.05, stats=st)
        if ref is None:
            assert got is None
            continue
        assert ref.objective <= got.objective <= ref.objective * 1.05 + 1e-12
        assert st.dp_runs >= 1 and st.stage_candidates > 0


def test_infeasible_is_none() -> None:
    times = np.full((1, 2, 3, 3), np.inf)
    assert solve_stages(stage_problem(times, [0], [1], [2], 1.0, 3.0)) is None


@pytest.mark.parametrize("seed", range(3))
def test_branch_and_bound_equals_the_ascending_scan(seed: int) -> None:
    """Rule R8 prices fewer t_max bounds than the scan it replaced and returns its very solution
    (stages, options, objective), also under an upper bound and with thinning."""
    rng = np.random.default_rng(100 + seed)
    runs_bb = 0
    for _ in range(60):
        p = _random_problem(rng)
        for eps, upper in ((0.0, np.inf), (0.05, np.inf), (0.0, float(rng.uniform(2, 30)))):
            st = DPStats()
            got, ref = solve_stages(p, epsilon=eps, upper=upper, stats=st), scan_stages(p, epsilon=eps, upper=upper)
            runs_bb += st.dp_runs
            assert (got is None) == (ref is None)
            if ref is not None:
                assert got.stages == ref.stages
                assert got.objective == ref.objective
    assert runs_bb > 0


def test_branch_and_bound_cuts_runs_on_many_candidates() -> None:
    """On a table with many distinct stage times the bound evaluates far fewer DPs than candidates."""
    rng = np.random.default_rng(5)
    num_units, opts = 12, 2
    times = np.full((opts, num_units, num_units + 1, num_units + 1), np.inf)
    speed = rng.uniform(0.5, 2.0, size=(opts, num_units))
    for o in range(opts):
        for k in range(num_units):
            for j in range(k + 1, num_units + 1):
                times[o, k, j, 1:] = speed[o, k:j].sum() * (1 + 0.01 * np.arange(num_units))
    p = stage_problem(times, [0, 0], [1, 2], [8], 1.0, 7.0)
    st = DPStats()
    got, ref = solve_stages(p, stats=st), scan_stages(p)
    assert got is not None and ref is not None and got.stages == ref.stages
    assert st.dp_runs < st.t_max_candidates / 10


def test_unbinding_capacity_is_dropped_exactly() -> None:
    """Rule R10: a segment whose capacity admits S stages of its widest option loses its slot
    dimension; the solution equals brute force on the untransformed problem."""
    rng = np.random.default_rng(11)
    for _ in range(30):
        p = _random_problem(rng)
        big = [c * 20 for c in p.capacities]  # every segment has slots to spare
        raw = StageProblem(p.times, p.option_segment, p.option_width, tuple(big), p.alpha, p.beta)
        q = stage_problem(p.times, p.option_segment, p.option_width, big, p.alpha, p.beta)
        assert q.capacities == (0,) * len(big) and set(q.option_width) == {0}
        got, ref = solve_stages(q), brute_force_stages(raw)
        assert (got is None) == (ref is None)
        if ref is not None:
            assert got.objective == pytest.approx(ref.objective, rel=1e-12)


def _full_product(p: StageProblem, t_max: float) -> list[np.ndarray]:
    """The DP table with every (k, j) in the min-plus product (the form before the band / corner
    restriction of ``inter_op._run``): the reference its floats must equal."""
    num_units, max_stages = p.num_units, p.max_stages
    times = np.where(p.times <= t_max, p.times, np.inf)
    g = [np.full((max_stages + 1, num_units + 1, cap + 1), np.inf) for cap in p.capacities]
    for gi in g:
        gi[0, num_units, :] = 0.0
    for s in range(1, max_stages + 1):
        for i in reversed(range(len(g))):
            cur = g[i][s]
            if i + 1 < len(g):
                cur[:, :] = g[i + 1][s][:, p.capacities[i + 1], None]
            cap = p.capacities[i]
            for o, seg in enumerate(p.option_segment):
                w = p.option_width[o]
                if seg != i or w > cap:
                    continue
                c = times[o, :, :, s]
                cand = (c[:, :, None] + g[i][s - 1][None, :, : cap + 1 - w]).min(axis=1)
                np.minimum(cur[:num_units, w:], cand, out=cur[:num_units, w:])
    return g


@pytest.mark.parametrize("seed", range(3))
def test_restricted_product_equals_the_full_product(seed: int) -> None:
    """``_run`` computes only the corner ``s`` stages can reach and, under a tight ``t_max``, only
    stages as long as the longest that fits (a band): its tables equal the full product's, float
    for float (inf where inf), at every ``t_max`` candidate; so the plans are the same."""
    from partita.search.pipeline.inter_op import _run

    rng = np.random.default_rng(seed)
    bands = set()
    for _ in range(12):
        num_units = int(rng.integers(4, 14))
        nseg = int(rng.integers(1, 4))
        caps = [int(rng.integers(1, 12)) for _ in range(nseg)]
        opts = [(sg, w) for sg in range(nseg) for w in (1, 2, 4)]
        speed = rng.uniform(0.5, 2.0, size=(len(opts), num_units))
        times = np.full((len(opts), num_units, num_units + 1, num_units + 1), np.inf)
        budget = rng.uniform(4, 20)
        for o, (_sg, w) in enumerate(opts):
            for k in range(num_units):
                for j in range(k + 1, num_units + 1):
                    for s in range(1, num_units + 1):
                        if (j - k) * s / w <= budget:
                            times[o, k, j, s] = speed[o, k:j].sum() / w**0.8 + 0.1
        p = stage_problem(times, [o[0] for o in opts], [o[1] for o in opts], caps, 1.0, 3.0)
        finite = np.unique(times[np.isfinite(times)])
        for t_max in [*finite[:: max(1, len(finite) // 6)], np.inf]:
            got, ref = _run(p, float(t_max)), _full_product(p, float(t_max))
            assert all(np.array_equal(a, b) for a, b in zip(got, ref))
            fits = np.isfinite(np.where(times <= t_max, times, np.inf))
            bands.add(int(max((j - k for _o, k, j, _s in zip(*np.nonzero(fits))), default=0)) < num_units // 2)
    assert bands == {True, False}  # both the band and the square corner were exercised
