"""Plan contract: JSON round-trip, determinism, validation of corrupt / foreign plans."""

import json

import pytest

from partita.errors import PlanError
from partita.plan import Collective, Plan, Stage


def make_plan() -> Plan:
    stages = (
        Stage(
            0,
            ("embed", "h.0"),
            "A100-80G",
            (0, 1, 2, 3),
            dp=2,
            tp=2,
            param_placements={"w": ("R", "S(0)")},
            collectives=(Collective("all_reduce", "tp", 1.5e6, 2, "forward", "row-parallel"),),
            predicted={"compute_s": 0.1, "memory_bytes": 1e9},
        ),
        Stage(1, ("h.1", "head"), "V100-32G", (4, 5), dp=2, tp=1, batch_shares=(3, 1)),
    )
    return Plan(
        model={"name": "m", "layers": ["embed", "h.0", "h.1", "head"]},
        cluster={"name": "c"},
        training={"global_batch": 16, "seq_len": 8},
        stages=stages,
        schedule="1f1b",
        micro_batch_size=2,
        num_micro_batches=4,
        predicted={"step_time_s": 1 / 3, "compute_s": 0.25, "communication_s": 0.05, "bubble_s": 1 / 30},
        partita_version="0.1.0",
    )


def test_roundtrip_and_determinism() -> None:
    p = make_plan()
    text = p.to_json()
    assert Plan.from_json(text).to_json() == text
    assert make_plan().to_json() == text
    assert p.world_size == 6 and p.stage_of_rank(5).index == 1 and p.stages[0].coords(3) == (1, 1)


def test_truncated_plan() -> None:
    text = make_plan().to_json()
    with pytest.raises(PlanError, match="not valid JSON"):
        Plan.from_json(text[: len(text) // 2])


def test_other_version() -> None:
    d = json.loads(make_plan().to_json())
    d["version"] = 99
    with pytest.raises(PlanError, match="plan version 99"):
        Plan.from_dict(d)


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda d: d["stages"][1].update(ranks=[4]), "dp=2, tp=1 but 1 ranks"),
        (lambda d: d["stages"][1].update(batch_shares=[1, 1]), "batch_shares"),
        (lambda d: d.update(schedule="zigzag"), "schedule 'zigzag'"),
        (lambda d: d["stages"][1].update(layers=["h.1"]), "stages cover layers"),
        (lambda d: d.pop("stages"), "missing or has a malformed field"),
        (lambda d: d.update(format="x"), "not a Partita plan"),
    ],
)
def test_validation(mutate, match: str) -> None:
    d = json.loads(make_plan().to_json())
    mutate(d)
    with pytest.raises(PlanError, match=match):
        Plan.from_dict(d)
