"""End to end on the JAX MLP: every plan of ``trained_plans`` (the search's forced shapes and the hand
layouts) trains like one device, and XLA compiles the searched plans' collectives; the launcher path
runs an interleaved plan as 1F1B and says so."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from jax_plan_cases import make_plan
from trained_plans import (
    HAND,
    RTOL,
    SEARCHED,
    check_hand_plan_hlo_follows_layout,
    check_matches_single_device,
    check_searched_plan_collectives_equal_hlo,
    train_all,
    write_plan,
)

from partita.backends.jax.run import run

MODEL = "jax-mlp"


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


def test_run_prints_interleaved_fallback(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The launcher path (`partita run DIR --reference`): an interleaved plan runs as 1F1B and says so."""
    plan = make_plan("jax-mlp", "pp", schedule="interleaved_1f1b")
    d = write_plan(tmp_path, "pp", plan, "jax-mlp")
    res = run(d, steps=2, reference=True)
    np.testing.assert_allclose(res["losses"], res["reference_losses"], rtol=RTOL)
    assert res["max_grad_diff"] < 1e-5
    assert any("runs as plain 1F1B" in n for n in res["notes"])
    assert "runs as plain 1F1B" in capsys.readouterr().err
    assert res["collectives"]["stage0"]["p2p@pp"]["ops"] == plan.num_micro_batches
