"""plan.json writes a large stage's ranks as runs (issue 20: the plan file stays small at 16384 GPUs);
``Stage.ranks`` stays a tuple of every rank, small plans keep the plain list, old files still load."""

from __future__ import annotations

import dataclasses
import json

import pytest

from partita.errors import PlanError
from partita.plan import RANK_RUNS_ABOVE, Plan, Stage, rank_runs, ranks_from_runs
from tests.test_plan import make_plan


def big_plan(n: int) -> Plan:
    """Two stages over ``2n`` ranks: the first in order, the second with a hole-free but permuted tail."""
    second = tuple(range(n, 2 * n - 2)) + (2 * n - 1, 2 * n - 2)
    stages = (
        Stage(0, ("embed", "h.0"), "H100-80G", tuple(range(n)), dp=n // 8, tp=8),
        Stage(1, ("h.1", "head"), "A100-80G", second, dp=n // 8, tp=8),
    )
    training = {"global_batch": 2 * n // 8, "seq_len": 8}  # 2 micro-batches of 1 sample per replica
    return dataclasses.replace(make_plan(), stages=stages, training=training, micro_batch_size=1, num_micro_batches=2)


@pytest.mark.parametrize(
    ("ranks", "runs"),
    [
        ((), []),
        ((5,), [5]),
        ((0, 1, 2, 3), [[0, 3]]),
        ((0, 1, 2, 3, 8), [[0, 3], 8]),
        ((3, 2, 1), [3, 2, 1]),  # descending order is kept, rank by rank
        ((4, 5, 0, 1, 9), [[4, 5], [0, 1], 9]),
    ],
)
def test_runs_round_trip(ranks: tuple[int, ...], runs: list) -> None:
    assert rank_runs(ranks) == runs
    assert ranks_from_runs(runs) == ranks
    assert ranks_from_runs(list(ranks)) == ranks  # the plain list (every plan before runs) reads as itself


def test_large_plan_writes_runs_and_reads_back() -> None:
    n = 4096
    plan = big_plan(n)
    text = plan.to_json()
    d = json.loads(text)
    assert d["stages"][0]["ranks"] == [[0, n - 1]]
    assert d["stages"][1]["ranks"] == [[n, 2 * n - 3], 2 * n - 1, 2 * n - 2]
    back = Plan.from_json(text)
    assert back.stages == plan.stages and back.to_json() == text  # tuples in memory, byte-stable on disk
    assert back.world_size == 2 * n and back.stage_of_rank(2 * n - 1).index == 1
    plain = json.dumps({**d, "stages": [{**s, "ranks": list(t.ranks)} for s, t in zip(d["stages"], plan.stages)]})
    assert Plan.from_json(plain).stages == plan.stages  # a file written before runs still loads
    assert len(text) < 20_000 < len(plain)


def test_rank_map_is_written_as_runs() -> None:
    n = 256
    plan = dataclasses.replace(big_plan(n), cluster={"name": "c", "rank_map": list(range(8, 8 + 2 * n))})
    d = json.loads(plan.to_json())
    assert d["cluster"]["rank_map"] == [[8, 7 + 2 * n]]
    assert Plan.from_json(plan.to_json()).cluster["rank_map"] == list(range(8, 8 + 2 * n))


def test_small_plan_keeps_the_plain_list() -> None:
    plan = make_plan()
    assert all(len(s.ranks) <= RANK_RUNS_ABOVE for s in plan.stages)
    d = json.loads(plan.to_json())
    assert [s["ranks"] for s in d["stages"]] == [[0, 1, 2, 3], [4, 5]]


@pytest.mark.parametrize("bad", [[[0]], [[0, 1, 2]], [[5, 2]], [[0, 1 << 30]], [{"a": 1}], [[0, "x"]]])
def test_malformed_runs_are_a_plan_error(bad: list) -> None:
    d = json.loads(big_plan(128).to_json())
    d["stages"][0]["ranks"] = bad
    with pytest.raises(PlanError, match="malformed field"):
        Plan.from_dict(d)
