"""End to end on the JAX tiny GPT: every plan of ``trained_plans`` (the search's forced shapes and the
hand layouts) trains like one device, XLA compiles the searched plans' collectives, and ``partita
rehearse`` compiles what the run compiled."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from trained_plans import (
    HAND,
    SEARCHED,
    check_hand_plan_hlo_follows_layout,
    check_matches_single_device,
    check_searched_plan_collectives_equal_hlo,
    train_all,
)

from partita.plan import Plan

MODEL = "jax-gpt-tiny"


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The folder where this model's plans were trained (once, in one subprocess)."""
    return train_all(tmp_path_factory.mktemp(MODEL), MODEL)


@pytest.mark.parametrize("name", [f"searched_{n}" for n in SEARCHED[MODEL]] + [f"hand_{n}" for n in HAND[MODEL]])
def test_matches_single_device(trained: Path, name: str) -> None:
    check_matches_single_device(trained, name)


@pytest.mark.parametrize("name", SEARCHED[MODEL])
def test_searched_plan_collectives_equal_hlo(trained: Path, name: str) -> None:
    check_searched_plan_collectives_equal_hlo(trained, MODEL, name)


def test_hand_plan_hlo_follows_layout(trained: Path) -> None:
    check_hand_plan_hlo_follows_layout(trained, MODEL)


@pytest.mark.parametrize("name", ["zero3", "pp"])
def test_rehearsal_compiles_what_the_run_compiled(trained: Path, name: str) -> None:
    """``partita rehearse`` on a JAX plan (``backends/jax/rehearse.py``: the step lowered and compiled
    on abstract inputs, nothing allocated) sees exactly the collectives the real run compiled and sent,
    per stage, ``kind@axis``, ops and bytes. Its FLOPs (XLA's cost analysis) are the plan's within 10%:
    XLA also counts element-wise ops and the Adam update, which the plan's FLOPs (matmuls, as torch's
    flop counter) leave out, +5.5% on this tiny GPT's pipeline stage (h=64); at real sizes matmuls dominate."""
    from partita.backends.jax.fidelity import PLAN_KINDS
    from partita.driver import rehearse

    tmp = trained
    ran = json.loads((tmp / f"searched_{name}.json").read_text())["collectives"]
    plan = Plan.from_json((tmp / f"searched_{name}" / "plan.json").read_text())
    got = rehearse(str(tmp / f"searched_{name}"))
    assert [s["index"] for s in got["stages"]] == [s.index for s in plan.stages]
    hlo_kind = {v: k for k, v in PLAN_KINDS.items()}
    for st in got["stages"]:
        measured = {
            f"{hlo_kind.get(k.split('@')[0], k.split('@')[0])}@{k.split('@')[1]}": {
                "ops": v["ops"],
                "bytes": v["bytes"],
            }
            for k, v in ran[f"stage{st['index']}"].items()
        }
        rehearsed = {k: {"ops": v["count"], "bytes": v["bytes"]} for k, v in st["collectives"].items()}
        assert rehearsed == measured, (name, st["index"])
        assert st["flops"] == pytest.approx(st["planned_flops"], rel=0.10)
        assert st["peak_memory_bytes"] > sum(st["memory_by_category"][c] for c in ("parameters", "optimizer"))
