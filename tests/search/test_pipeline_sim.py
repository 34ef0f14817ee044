"""The pipeline simulator against the schedules' closed forms, and the action lists it runs."""

from __future__ import annotations

import pytest

from partita.errors import ConfigError
from partita.search.pipeline import schedule as sched
from partita.search.pipeline.pipeline_sim import ScheduleDeadlock, simulate
from partita.search.pipeline.schedule import Action, pipeline_actions

FAMILIES = (("gpipe", 1), ("1f1b", 1), ("zb_h1", 1), ("interleaved_1f1b", 2), ("interleaved_1f1b", 3), ("zbv", 2))


@pytest.mark.parametrize("p", [1, 2, 3, 4, 6])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 7, 8, 12])
@pytest.mark.parametrize(("family", "v"), FAMILIES)
def test_lists_are_complete_placed_and_runnable(family: str, v: int, p: int, m: int) -> None:
    try:
        lists = pipeline_actions(family, p, m, v)
    except ConfigError:
        assert family == "interleaved_1f1b" and m % max(1, m // p)  # the one refusal: uneven rounds
        return
    kinds = ("F", "B", "W") if sched.splits_backward(family) else ("F", "B")
    want = {Action(s, i, k) for s in range(p * v) for i in range(m) for k in kinds}
    got = [a for r in lists for a in r]
    assert len(got) == len(want) and set(got) == want  # each exactly once
    for rank, acts in enumerate(lists):
        assert all(sched.stage_rank(family, a.stage, p, v) == rank for a in acts)
        for a in acts:  # F before B before W of the same stage and micro-batch on its rank
            if a.kind != "F":
                before = acts[: acts.index(a)]
                assert Action(a.stage, a.micro, "F") in before
                if a.kind == "W":
                    assert Action(a.stage, a.micro, "B") in before
    simulate(family, p, m, 1.0, 1.0, 0.5, p2p=0.25, num_virtual=v)  # raises on a deadlock


def test_a_bad_order_deadlocks() -> None:
    lists = pipeline_actions("1f1b", 2, 2)
    lists[0] = [Action(0, 0, "F"), Action(0, 1, "B"), Action(0, 1, "F"), Action(0, 0, "B")]
    lists[0][1], lists[0][2] = lists[0][2], lists[0][1]  # still fine: F0.1 before B0.1
    simulate("1f1b", 2, 2, 1.0, 1.0, actions=lists)
    lists[1] = [Action(1, 1, "F"), Action(1, 1, "B"), Action(1, 0, "F"), Action(1, 0, "B")]
    lists[0] = [Action(0, 0, "F"), Action(0, 0, "B"), Action(0, 1, "F"), Action(0, 1, "B")]
    with pytest.raises(ScheduleDeadlock):  # rank 0 waits for B1.0, rank 1 for F0.1 that follows B0.0
        simulate("1f1b", 2, 2, 1.0, 1.0, actions=lists)


@pytest.mark.parametrize(("p", "m"), [(2, 4), (4, 8), (4, 16), (8, 32), (3, 7)])
@pytest.mark.parametrize(("f", "b", "w"), [(1.0, 1.0, 1.0), (1.0, 1.4, 0.6), (2.0, 1.0, 0.5)])
def test_uniform_closed_forms(p: int, m: int, f: float, b: float, w: float) -> None:
    t = f + b + w
    for family in ("gpipe", "1f1b"):
        got = simulate(family, p, m, f, b, w)
        assert got.step_s == pytest.approx((m + p - 1) * t, rel=1e-9)
        assert got.step_s == pytest.approx(sched.pipeline_time([t] * p, family, m).step_s, rel=1e-9)
    zb = simulate("zb_h1", p, m, f, b, w)  # Qi et al.: bubble (p - 1)(T_F + T_B - T_W)
    assert zb.bubble_s == pytest.approx((p - 1) * (f + b - w), rel=0.01)
    assert zb.bubble_s < simulate("1f1b", p, m, f, b, w).bubble_s
    for v in (2, 3, 4):
        if m % p:
            continue
        inter = simulate("interleaved_1f1b", p, m, f / v, b / v, w / v, num_virtual=v)
        assert inter.bubble_s / (m * t) == pytest.approx((p - 1) / (v * m), rel=0.01)  # Megatron
        assert inter.step_s == pytest.approx(sched.pipeline_time([t] * p, "interleaved_1f1b", m, v).step_s, rel=0.01)


def test_p2p_adds_to_the_critical_path_only_between_ranks() -> None:
    base = simulate("gpipe", 4, 8, 1.0, 2.0)
    slow = simulate("gpipe", 4, 8, 1.0, 2.0, p2p=0.1)
    assert slow.step_s == pytest.approx(base.step_s + 2 * 3 * 0.1)  # fill and drain cross 3 links each way
    base, slow = simulate("1f1b", 4, 8, 1.0, 2.0), simulate("1f1b", 4, 8, 1.0, 2.0, p2p=0.1)
    assert base.step_s + 2 * 3 * 0.1 <= slow.step_s <= base.step_s + (8 + 3) * 2 * 0.1  # steady state waits too
    v_free = simulate("zbv", 2, 4, 0.5, 0.5, 0.5, num_virtual=2, p2p=[1.0, 0.0, 1.0])
    v_slow = simulate("zbv", 2, 4, 0.5, 0.5, 0.5, num_virtual=2, p2p=[1.0, 5.0, 1.0])
    assert v_slow.step_s == v_free.step_s  # stages 1 and 2 share rank 1: no p2p at the turn of the V


def test_in_flight_from_the_lists_equals_the_closed_forms() -> None:
    for p, m in [(4, 8), (4, 2), (8, 16), (3, 9)]:
        one = simulate("1f1b", p, m, 1.0, 1.0)
        assert list(one.peak_activations) == [min(p - i, m) for i in range(p)]
        assert [sched.in_flight("1f1b", i, p, m) for i in range(p)] == list(one.peak_activations)
        assert list(simulate("gpipe", p, m, 1.0, 1.0).peak_activations) == [m] * p
        zb = simulate("zb_h1", p, m, 1.0, 1.0, 1.0)
        assert list(zb.peak_activations) == list(one.peak_activations)  # B frees as in 1F1B
        assert max(zb.peak_in_flight) == max(one.peak_in_flight) == min(p, m)  # ZB-H1 keeps 1F1B's peak
        assert [sched.in_flight("zb_h1", i, p, m, w_held=1.0) for i in range(p)] == [float(min(p, m))] * p
        # between B and W a micro-batch also holds the output gradients W needs: weighted w_held
        held = [0.0] * p
        for r, acts in enumerate(pipeline_actions("zb_h1", p, m)):
            fwd = dfr = 0
            for a in acts:
                fwd += {"F": 1, "B": -1}.get(a.kind, 0)
                dfr += {"B": 1, "W": -1}.get(a.kind, 0)
                held[r] = max(held[r], fwd + 1.5 * dfr)
        assert sched.peak_in_flight("zb_h1", p, m, 1, 1.5) == tuple(held)
        # each position at its own rank's list (search/zero_bubble.per_position), the last the most loaded
        assert [sched.in_flight("zb_h1", i, p, m, w_held=1.5) for i in range(p)] == held
        assert max(held) > min(p, m)
        if m % p == 0:
            v = 2
            inter = simulate("interleaved_1f1b", p, m, 1.0, 1.0, num_virtual=v)
            per_rank = [sum(inter.peak_activations[c * p + r] for c in range(v)) / v for r in range(p)]
            closed = [min((p - i - 1) * 2 + (v - 1) * p + 1, m * v) / v for i in range(p)]
            assert [sched.in_flight("interleaved_1f1b", i, p, m, v) for i in range(p)] == closed
            assert all(a >= c for a, c in zip(per_rank, closed, strict=True))  # per-chunk peaks bound it


def test_zbv_beats_zb_h1_at_the_same_peak_memory() -> None:
    p, m = 4, 16
    zb = simulate("zb_h1", p, m, 1.0, 1.0, 1.0)
    zbv = simulate("zbv", p, m, 0.5, 0.5, 0.5, num_virtual=2)
    assert zbv.bubble_s < zb.bubble_s / 1.5
    assert [sched.in_flight("zbv", i, p, m, 2, w_held=1.0) for i in range(p)] == [float(p)] * p


def test_busy_and_idle_add_up() -> None:
    got = simulate("zb_h1", 4, 8, [1.0, 1.2, 0.8, 1.0], [1.0, 1.0, 1.5, 1.0], [0.5, 0.5, 0.5, 0.7], p2p=0.05)
    for r in range(4):
        work = sum(b.end_s - b.start_s for b in got.boxes if b.rank == r)
        assert got.busy_s[r] == pytest.approx(work)
        assert got.busy_s[r] + got.idle_s[r] == pytest.approx(got.step_s)
        mine = sorted((b.start_s, b.end_s) for b in got.boxes if b.rank == r)
        assert all(e <= s2 + 1e-12 for (_, e), (s2, _) in zip(mine, mine[1:], strict=False))  # one at a time


def test_step_time_equals_the_simulation_to_the_last_bit() -> None:
    """The planner's table-driven ``step_time`` is ``simulate(...).step_s`` exactly, for every schedule."""
    import random

    from partita.search.pipeline import pipeline_sim as ps
    from partita.search.pipeline.schedule import SCHEDULE_FAMILIES

    rng = random.Random(0)
    checked = 0
    for family in SCHEDULE_FAMILIES:
        v = 2 if family in ("interleaved_1f1b", "zbv") else 1
        for p in (1, 2, 3, 4, 8):
            for m in (1, 3, 4, 8, 16):
                try:
                    ps.pipeline_actions(family, p, m, v)
                except Exception:
                    continue  # counts the schedule refuses (interleaved rounds)
                n = p * ps.virtual_stages(family, v)
                f, b = [rng.random() for _ in range(n)], [rng.random() for _ in range(n)]
                w, c = [rng.random() / 2 for _ in range(n)], [rng.random() / 10 for _ in range(n - 1)]
                want = ps.simulate(family, p, m, f, b, w, c, num_virtual=v).step_s
                assert ps.step_time(family, p, m, f, b, w, c, num_virtual=v) == want, (family, p, m)
                checked += 1
    assert checked > 60
