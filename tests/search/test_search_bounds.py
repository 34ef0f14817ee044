"""Rule R6 (issue 20): the step bound that cuts solves and configurations, and what it must not change.

The bound is ``m`` times the slowest stage's period plus a tail bound (``step_bounds.floor``). These tests
check it against the simulator it bounds, check that the zero-bubble pre-check's counts are below every
count a depth pass prices, and check that the search with the bound finds what the search without any
cut finds: each configuration's best, and the plan with its per-schedule bests.
"""

from __future__ import annotations

import json
import math
import random
import types
from typing import Any

import numpy as np
import pytest

from partita.cluster import parse_cluster
from partita.search.entry import planner
from partita.search.pipeline import inter_op, step_bounds
from partita.search.pipeline import schedule as sched
from partita.search.pipeline.pipeline_sim import simulate
from partita.search.pipeline.zero_bubble import counts, least_counts
from partita.search.pricing.config import SearchOptions, TrainingConfig


@pytest.mark.parametrize(("schedule", "v"), [("1f1b", 1), ("gpipe", 1), ("zb_h1", 1), ("interleaved_1f1b", 2)])
def test_floor_bounds_every_simulated_step(schedule: str, v: int) -> None:
    rng = random.Random(7)
    closed_form_above = 0
    for _ in range(400):
        p, m = rng.randint(2, 6), rng.choice([1, 2, 3, 4, 6, 8, 12])
        if schedule == "interleaved_1f1b" and m % p:
            continue
        n = p * v
        f = [rng.uniform(0.05, 2.0) for _ in range(n)]
        b = [rng.uniform(0.05, 2.0) for _ in range(n)]
        w = [rng.uniform(0.0, 1.0) for _ in range(n)]
        p2p = [rng.uniform(0.0, 0.3) for _ in range(n - 1)]
        step = simulate(schedule, p, m, f, b, w, p2p=p2p, num_virtual=v).step_s
        # a rank's period per micro-batch: its chunks' F + B + W (the DP's stage time)
        per_rank = [0.0] * p
        for s in range(n):
            per_rank[sched.stage_rank(schedule, s, p, v)] += f[s] + b[s] + w[s]
        tail = rng.uniform(0.0, 1.0)
        assert step_bounds.floor(m, max(per_rank), tail) <= step + tail
        assert step_bounds.t_limit(m, tail, step + tail) >= max(per_rank)  # the limit keeps this pipeline
        if v == 1 and step < sched.pipeline_time(per_rank, schedule, m).step_s * (1 - 1e-9):
            closed_form_above += 1
    if schedule == "1f1b":  # why R6 does not bound with the DP's closed form (the old rule R7 cut did)
        assert closed_form_above > 0


@pytest.mark.parametrize(("schedule", "v"), [("1f1b", 1), ("gpipe", 1), ("zb_h1", 1), ("interleaved_1f1b", 2)])
def test_chain_floors_bound_every_simulated_step(schedule: str, v: int) -> None:
    """``step_bounds.chains``' bounds (``inter_op.chain_floor``'s ``max_r (lead (t_0 + .. + t_{r-1}) + m t_r)``
    times ``scale``) against the simulator, on ranks of random F / B / W splits spread over their chunks
    as ``schedule_cost`` spreads them: below every step, and tighter than ``m t`` where the slow rank
    comes late."""
    rng = random.Random(11)
    tighter = 0
    for _ in range(300):
        p, m = rng.randint(2, 5), rng.choice([1, 2, 3, 4, 6, 8])
        if schedule == "interleaved_1f1b" and m % p:
            continue
        f = [rng.uniform(0.05, 2.0) for _ in range(p)]
        b = [rng.uniform(0.05, 2.0) for _ in range(p)]
        w = [rng.uniform(0.0, 1.0) for _ in range(p)]
        t = [x + y + z for x, y, z in zip(f, b, w)]
        on = [sched.stage_rank(schedule, s, p, v) for s in range(p * v)]
        chunk = [[x[r] / v for r in on] for x in (f, b, w)]
        step = simulate(schedule, p, m, *chunk, num_virtual=v).step_s
        search = types.SimpleNamespace()  # only the shares chains() reads (kept on the search)
        search.__dict__["_step_shares"] = (min(x / y for x, y in zip(f, t)), max(x / y for x, y in zip(w, t)))
        best = 0.0
        for lead, scale in step_bounds.chains(search, 1, 1, schedule, v):
            chain = max(lead * sum(t[:r]) + m * t[r] for r in range(p))
            assert step_bounds.floor(1, scale * chain, 0.0) <= step
            best = max(best, scale * chain)
        tighter += best > m * max(t) * (1 + 1e-9)
    assert tighter > 50


@pytest.mark.parametrize("seed", range(3))
def test_chain_floor_equals_brute_force(seed: int) -> None:
    from tests.search.test_inter_op import _random_problem

    rng = np.random.default_rng(seed)
    for _ in range(30):
        p = _random_problem(rng)
        m = int(p.beta) + 1
        sol = inter_op.brute_force_stages(p, lambda ts, m=m: max(sum(ts[:r]) + m * ts[r] for r in range(len(ts))))
        got = inter_op.chain_floor(p, m)
        assert got == math.inf if sol is None else got == pytest.approx(sol.objective, rel=1e-12)


@pytest.mark.parametrize("held", [1.0, 1.3, 2.0, 3.5])
def test_least_counts_are_below_every_depth(held: float) -> None:
    for m in (1, 2, 3, 5, 8, 16):
        low = least_counts("zb_h1", m, 12)
        assert low is not None
        for depth in range(1, 13):
            for s in range(1, depth + 1):  # the stage with s stages left sits at position depth - s
                got = float(counts("zb_h1", depth, m, 1, np.array(held), depth - s))
                assert low[s] <= got + 1e-12, (m, depth, s, got)
    assert least_counts("zbv", 4, 4) is None  # not proved for it: never used


def _unpruned(monkeypatch: pytest.MonkeyPatch) -> None:
    """The search with no R6 cut anywhere (every stage sequence kept, every zero-bubble pass run)."""
    monkeypatch.setattr(planner, "t_limit", lambda m, tail, bar: math.inf)
    monkeypatch.setattr(planner, "time_floor", lambda *a, **k: 0.0)
    monkeypatch.setattr(step_bounds, "time_floor", lambda *a, **k: 0.0)
    monkeypatch.setattr(step_bounds, "can_beat", lambda *a, **k: True)
    monkeypatch.setattr(planner, "chain_bound", lambda *a, **k: 0.0)


def _body(plan: Any) -> dict[str, Any]:
    """The plan file without its ``search`` statistics (alternatives and counts differ by design)."""
    d = json.loads(plan.to_json())
    d.pop("search")
    return d


def _llama() -> tuple[Any, TrainingConfig]:
    from partita.frontends.stored import load_stored
    from partita.frontends.trace import TRACE_BATCH, trace_handle
    from partita.models import resolve_model

    g = load_stored("llama-7b", 2048, TRACE_BATCH) or trace_handle(
        resolve_model("llama-7b"), batch=TRACE_BATCH, seq=2048
    )
    return g, TrainingConfig(global_batch=8, seq_len=2048)


@pytest.mark.slow
def test_tail_caps_keep_each_configurations_best(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rule R7 used to stop re-solving once the DP's closed form, minus a tail bound, could not beat the
    best: llama-7b on 64 H100s at dp 2, b 1 then kept a 0.1535 s step where re-solving finds 0.1496 s."""
    g, training = _llama()
    cluster = parse_cluster("64xH100-80G")

    def bests() -> dict[tuple[int, int], tuple[float, str]]:
        search = planner.Search(g, cluster, training, SearchOptions())
        out = {}
        for dp, b in [(1, 1), (2, 1), (2, 2), (4, 1)]:
            got = min(search.solve_config(dp, b, "1f1b"), key=lambda c: c.step_time)
            out[dp, b] = (got.step_time, got.summary())
        return out

    pruned = bests()
    _unpruned(monkeypatch)
    assert pruned == bests()


@pytest.mark.slow
def test_r6_plan_and_schedule_bests_equal_the_unpruned_search(monkeypatch: pytest.MonkeyPatch) -> None:
    g, training = _llama()
    cluster = parse_cluster("32xA100-80G+32xV100-32G")
    training = TrainingConfig(global_batch=64, seq_len=2048)
    pruned = planner.plan_graph(g, cluster, training)
    _unpruned(monkeypatch)
    full = planner.plan_graph(g, cluster, training)
    assert _body(pruned) == _body(full)
    assert pruned.search["schedules"] == full.search["schedules"]  # what the report compares schedules with
    assert pruned.search["dp_runs"] < full.search["dp_runs"]


@pytest.mark.slow
def test_prefetch_in_workers_gives_the_serial_plan(monkeypatch: pytest.MonkeyPatch) -> None:
    """The layer ILPs solved in two forked workers (``search/entry/prefetch.py``), the zero-bubble configurations
    and the report's yardstick beside the search, or all of it here, one after another: the same plan
    file, statistics included."""
    from partita.search.entry import prefetch
    from partita.search.entry.hand_best import yardstick
    from partita.search.layer.memo import IntraOpMemo

    g, _ = _llama()
    cluster = parse_cluster("16xA100-80G+16xV100-32G")
    training = TrainingConfig(global_batch=32, seq_len=2048)
    monkeypatch.setattr(prefetch, "MIN_SOLVES", 1)
    solved = []
    real = prefetch.prefetch
    monkeypatch.setattr(planner, "prefetch", lambda costs, wanted: solved.append(real(costs, wanted)) or solved[-1])
    plans = {}
    for n in ("2", "1"):  # the zero-bubble loop, the yardstick and the hash beside the search, or after it
        monkeypatch.setenv("PARTITA_WORKERS", n)
        memo = IntraOpMemo()
        plan = planner.plan_graph(g, cluster, training, memo=memo, yardstick=yardstick(g, cluster, memo))
        plans[n] = plan.to_json()
    assert plans["2"] == plans["1"]
    assert (
        "best_hand_layout" in json.loads(plans["1"])["search"]
        and "zb_h1" in json.loads(plans["1"])["search"]["schedules"]
    )
    assert solved[0] > 0 and solved[:2] == solved[2:]  # the same solves, by workers and here
