"""Pipeline latency and in-flight formulas."""

from __future__ import annotations

import pytest

from partita.errors import ConfigError
from partita.search import schedule as sched


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
