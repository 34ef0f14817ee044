"""Golden files of the generated JAX programs, and the emitter's refusals.

``UPDATE_GOLDEN=1 pytest tests/runtime_jax/test_emit_jax.py`` rewrites tests/golden/emit_jax/.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest
from jax_plan_cases import make_plan

from partita.compiler.emit_jax import emit_jax
from partita.errors import PlanError

GOLDEN = Path(__file__).parent.parent / "golden" / "emit_jax"
CASES = [
    ("jax-mlp", "dp_tp", "gpipe", "adamw"),
    ("jax-mlp", "zero3", "gpipe", "sgd"),
    ("jax-mlp", "pp", "1f1b", "adam"),
    ("jax-gpt-tiny", "tp", "gpipe", "adamw"),
    ("jax-gpt-tiny", "pp", "1f1b", "adamw"),
]


@pytest.mark.parametrize("model,layout,schedule,optimizer", CASES)
def test_golden_program(model: str, layout: str, schedule: str, optimizer: str) -> None:
    text = emit_jax(make_plan(model, layout, schedule=schedule, optimizer=optimizer), model)
    path = GOLDEN / f"{model}_{layout}_{schedule}.py"
    if os.environ.get("UPDATE_GOLDEN"):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    assert path.exists(), f"missing golden {path}; run with UPDATE_GOLDEN=1"
    assert text == path.read_text(), f"{path.name} changed; rerun with UPDATE_GOLDEN=1 if intended"
    compile(text, str(path), "exec")  # the program is valid Python
    assert text == emit_jax(make_plan(model, layout, schedule=schedule, optimizer=optimizer), model)


def test_program_shows_the_plan() -> None:
    text = emit_jax(make_plan("jax-mlp", "zero3", optimizer="sgd"), "jax-mlp")
    assert '"params.fc1.kernel": P("dp"),  # (S(0), R)' in text
    assert '"params.fc1.bias": P("dp"),  # not in plan: (R, R); ZeRO-3 over dp' in text
    assert "optax.sgd(learning_rate=0.001)" in text
    pp = emit_jax(make_plan("jax-mlp", "pp", schedule="1f1b"), "jax-mlp")
    assert "SCHEDULE = [" in pp and '("F", 0, 0), ("B", 1, 0)' in pp


def test_uneven_shares_are_refused() -> None:
    plan = make_plan("jax-mlp", "dp")
    st = dataclasses.replace(plan.stages[0], batch_shares=(1, 1, 2, 4))
    with pytest.raises(PlanError, match="unevenly"):
        emit_jax(dataclasses.replace(plan, stages=(st,)), "jax-mlp")


def test_partial_parameter_placement_is_refused() -> None:
    plan = make_plan("jax-mlp", "tp")
    st = dataclasses.replace(plan.stages[0], param_placements={"params.fc1.kernel": ("R", "P")})
    with pytest.raises(PlanError, match="cannot lay out"):
        emit_jax(dataclasses.replace(plan, stages=(st,)), "jax-mlp")
