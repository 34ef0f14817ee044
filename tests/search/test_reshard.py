"""Resharding steps and costs on 1-D and 2-D meshes."""

from __future__ import annotations

import pytest

from partita.cluster import DEVICE_PRESETS
from partita.search.layer.reshard import reshard_cost, reshard_steps
from partita.search.pricing.cost_model import CostModel
from partita.search.pricing.mesh import LogicalMesh

A100 = DEVICE_PRESETS["A100-80G"]
M1 = LogicalMesh((8,), ("tp",), A100, 8)
M2 = LogicalMesh((2, 4), ("dp", "tp"), A100, 4)  # dp crosses nodes
GB = 1e9


def kinds(src, dst, mesh=M1, nbytes=GB):
    return [(s.kind, s.axis, s.bytes) for s in reshard_steps(src, dst, nbytes, mesh)]


def test_one_axis_transitions() -> None:
    assert kinds(("R",), ("S(0)",)) == []
    assert kinds(("R",), ("P",)) == []
    assert kinds(("S(0)",), ("R",)) == [("all_gather", 0, GB)]
    assert kinds(("P",), ("R",)) == [("all_reduce", 0, GB)]
    assert kinds(("P",), ("S(1)",)) == [("reduce_scatter", 0, GB)]
    assert kinds(("S(0)",), ("S(1)",)) == [("all_to_all", 0, GB / 8)]


def test_two_axis_sizes_account_for_other_axes() -> None:
    # dp sharded on dim 0 stays, tp all-gathers dim 1: the buffer is already halved by dp
    assert kinds(("S(0)", "S(1)"), ("S(0)", "R"), M2) == [("all_gather", 1, GB / 2)]
    # gather both: slowest link (dp, inter-node) first while tp still shards
    assert kinds(("S(0)", "S(1)"), ("R", "R"), M2) == [("all_gather", 0, GB / 4), ("all_gather", 1, GB)]
    # partial on tp, becomes sharded on dp first (free slice) then reduced on the smaller buffer
    assert kinds(("R", "P"), ("S(0)", "R"), M2) == [("all_reduce", 1, GB / 2)]


def test_cost_is_sum_of_step_times_and_zero_when_equal() -> None:
    cm = CostModel(A100)
    assert reshard_cost(("S(0)", "R"), ("S(0)", "R"), GB, M2, cm) == 0.0
    c = reshard_cost(("P",), ("R",), GB, M1, cm)
    assert c == pytest.approx(cm.collective_time("all_reduce", GB, M1.link(0)))
    # reduce-scatter + all-gather = all-reduce bandwidth, one more call latency
    rs_ag = reshard_cost(("P",), ("S(0)",), GB, M1, cm) + reshard_cost(("S(0)",), ("R",), GB, M1, cm)
    assert rs_ag == pytest.approx(c + cm.efficiency.collective_latency_s)
