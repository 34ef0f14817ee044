"""Pipeline latency and in-flight formulas."""

from __future__ import annotations

import pytest

from partita.errors import ConfigError
from partita.search.pipeline import schedule as sched


def test_1f1b_latency_and_bubble() -> None:
    pt = sched.pipeline_time([1.0, 2.0, 1.5], "1f1b", 8)
    assert pt.step_s == pytest.approx(4.5 + 7 * 2.0)
    assert pt.bubble_s == pytest.approx(pt.step_s - 8 * 2.0)
    assert sched.pipeline_time([1.0, 2.0, 1.5], "gpipe", 8).step_s == pt.step_s


def test_interleaved_matches_megatron_bubble_for_uniform_stages() -> None:
    p, m, v, t = 4, 16, 2, 1.0
    pt = sched.pipeline_time([t] * p, "interleaved_1f1b", m, v)
    assert pt.step_s == pytest.approx(m * t + (p - 1) * t / v)
    assert pt.step_s < sched.pipeline_time([t] * p, "1f1b", m).step_s


def test_in_flight() -> None:
    assert [sched.in_flight("1f1b", i, 4, 8) for i in range(4)] == [4, 3, 2, 1]
    assert sched.in_flight("1f1b", 0, 4, 2) == 2
    assert sched.in_flight("gpipe", 3, 4, 8) == 8
    assert sched.in_flight("interleaved_1f1b", 0, 4, 8, 2) == pytest.approx((6 + 4 + 1) / 2)


def test_bad_inputs() -> None:
    with pytest.raises(ConfigError):
        sched.pipeline_time([1.0], "zigzag", 4)
    with pytest.raises(ConfigError):
        sched.coefficients("1f1b", 4, 2)


def test_stage_rank_places_interleaved_round_robin_and_zbv_in_a_v() -> None:
    assert [sched.stage_rank("interleaved_1f1b", s, 4, 2) for s in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert [sched.stage_rank("zbv", s, 4, 2) for s in range(8)] == [0, 1, 2, 3, 3, 2, 1, 0]
    assert [sched.stage_rank("1f1b", s, 3, 1) for s in range(3)] == [0, 1, 2]
    with pytest.raises(ConfigError):
        sched.stage_rank("1f1b", 3, 3, 1)


def test_families_and_their_checks() -> None:
    assert set(sched.SCHEDULE_FAMILIES) >= {"gpipe", "1f1b", "interleaved_1f1b", "zb_h1", "zbv"}
    assert [f for f in sched.SCHEDULE_FAMILIES if sched.splits_backward(f)] == ["zb_h1", "zbv"]
    with pytest.raises(ConfigError):
        sched.pipeline_actions("zbv", 4, 8, 3)  # a V has two arms
    with pytest.raises(ConfigError):
        sched.pipeline_actions("zb_h1", 4, 8, 2)
    with pytest.raises(ConfigError):
        sched.pipeline_actions("interleaved_1f1b", 4, 9, 2)  # 2 rounds of 4.5 micro-batches
    assert sched.coefficients("zbv", 8, 2) == sched.coefficients("interleaved_1f1b", 8, 2)


def test_zb_h1_is_1f1b_with_deferred_weight_gradients() -> None:
    p, m = 4, 8
    one, zb = sched.pipeline_actions("1f1b", p, m), sched.pipeline_actions("zb_h1", p, m)
    for r in range(p):
        assert [a for a in zb[r] if a.kind != "W"] == one[r]  # F/B order unchanged
        b_done = w_done = lag = 0
        for a in zb[r]:
            b_done += a.kind == "B"
            w_done += a.kind == "W"
            lag = max(lag, b_done - w_done)
        assert lag == min(r + 1, m)  # rank r defers r weight gradients (plus the one just produced)


def test_orders_equal_torch_pipelinings_own_schedules() -> None:
    """Our generators (written from the papers) against torch.distributed.pipelining's schedule
    classes' per-rank orders, computed without processes (private helpers: skipped if they move)."""
    import types

    pytest.importorskip("torch")
    from torch.distributed.pipelining import schedules as ts

    try:
        ct = ts._ComputationType
        kind = {ct.FORWARD: "F", ct.FULL_BACKWARD: "B", ct.BACKWARD_INPUT: "B", ct.BACKWARD_WEIGHT: "W"}
        zbv_ops = ts.ScheduleZBVZeroBubble._calculate_single_rank_operations
        inter_ops = ts.ScheduleInterleaved1F1B._calculate_single_rank_operations
        one_ops = ts._get_1f1b_rank_ops
    except AttributeError as e:  # pragma: no cover - a torch upgrade moved the private helpers
        pytest.skip(f"torch's private schedule helpers moved: {e}")

    def theirs(ops: list) -> list[sched.Action]:
        return [sched.Action(a.stage_index, a.microbatch_index, kind[a.computation_type]) for a in ops if a]

    for p in (2, 3, 4):
        for m in (1, 2, 3, 5, 8, 12):
            ours = sched.pipeline_actions("zbv", p, m, 2)
            fake = types.SimpleNamespace(pp_group_size=p, num_stages=2 * p, _n_microbatches=m)
            assert [theirs(zbv_ops(fake, r)) for r in range(p)] == ours
            ours = sched.pipeline_actions("zb_h1", p, m)
            for r in range(p):
                w = min(p - 1 - r, m)
                ops = one_ops(1, p, w, m - w, w, r, lambda _s, r=r: r, lambda _s, r=r: r, r, enable_zero_bubble=True)
                assert theirs(ops) == ours[r]
            for v in (2, 3):
                rounds = max(1, m // p)
                if m % rounds:
                    continue
                fake = types.SimpleNamespace(
                    pp_group_size=p,
                    n_local_stages=v,
                    number_of_rounds=rounds,
                    microbatches_per_round=m // rounds,
                    _n_microbatches=m,
                )
                assert [theirs(inter_ops(fake, r)) for r in range(p)] == sched.pipeline_actions(
                    "interleaved_1f1b", p, m, v
                )


def test_the_plan_knows_every_family() -> None:
    from partita.plan import SCHEDULES

    assert SCHEDULES == sched.SCHEDULE_FAMILIES


def test_chunk_placement_is_one_definition() -> None:
    """The placement the simulator prices (``stage_rank``) is the one a chunked Plan records."""
    from partita.plan import chunk_position
    from partita.search.pipeline.schedule import stage_rank

    for p in (2, 3, 4):
        assert [stage_rank("zbv", s, p, 2) for s in range(2 * p)] == [chunk_position("zbv", s, p) for s in range(2 * p)]
        assert [chunk_position("zbv", s, p) for s in range(2 * p)] == [*range(p), *reversed(range(p))]
        for v in (2, 3):
            got = [stage_rank("interleaved_1f1b", s, p, v) for s in range(p * v)]
            assert (
                got == [chunk_position("interleaved_1f1b", s, p) for s in range(p * v)] == [s % p for s in range(p * v)]
            )
