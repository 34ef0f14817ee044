"""Golden files of the generated JAX programs, what they show, and the emitter's refusals.

``UPDATE_GOLDEN=1 pytest tests/runtime_jax/test_emit_jax.py`` rewrites tests/golden/emit_jax/ (hand-made
plans, so a change in the search does not move them; ``.py.golden`` so ruff leaves them as emitted).
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest
from jax_plan_cases import make_plan
from searched_plans import CASES, searched_plan

from partita.backends.jax.emit import emit_jax
from partita.errors import PlanError

GOLDEN = Path(__file__).parent.parent / "golden" / "emit_jax"
GOLDEN_CASES = [
    ("jax-mlp", "dp_tp", "gpipe", "adamw"),
    ("jax-mlp", "zero3", "gpipe", "sgd"),
    ("jax-mlp", "uneven", "1f1b", "adam"),
    ("jax-mlp", "pp", "1f1b", "adam"),
    ("jax-gpt-tiny", "tp", "gpipe", "adamw"),
    ("jax-gpt-tiny", "pp", "interleaved_1f1b", "adamw"),
]


@pytest.mark.parametrize("model,layout,schedule,optimizer", GOLDEN_CASES)
def test_golden_program(model: str, layout: str, schedule: str, optimizer: str) -> None:
    text = emit_jax(make_plan(model, layout, schedule=schedule, optimizer=optimizer), model)
    path = GOLDEN / f"{model}_{layout}_{schedule}.py.golden"
    if os.environ.get("UPDATE_GOLDEN"):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    assert path.exists(), f"missing golden {path}; run with UPDATE_GOLDEN=1"
    assert text == path.read_text(), f"{path.name} changed; rerun with UPDATE_GOLDEN=1 if intended"
    compile(text, str(path), "exec")  # the program is valid Python
    assert text == emit_jax(make_plan(model, layout, schedule=schedule, optimizer=optimizer), model)


def test_program_shows_the_plan() -> None:
    text = emit_jax(make_plan("jax-mlp", "zero3", optimizer="sgd"), "jax-mlp")
    assert '"params.fc1.kernel": P("dp"),  # stage 0 (S(0), R)' in text
    assert '"params.fc1.bias": P("dp"),  # stage 0 not in plan: (R, R); ZeRO-3 over dp' in text
    assert "optax.sgd(learning_rate=0.001)" in text
    assert '"stage0": {},' in text  # a hand plan records no collectives: the program predicts none of its own
    searched = searched_plan("jax-mlp", **CASES["zero3"])  # its records, folded by kind@axis, are the prediction
    gathers = [c for c in searched.stages[0].collectives if c.kind == "all_gather"]
    n = sum(c.count for c in gathers)
    assert n == 4 * searched.num_micro_batches  # ZeRO-3: each of the MLP's 4 tensors, per micro-batch
    assert f'"all-gather@dp": {{"ops": {n}, "bytes": {sum(c.bytes * c.count for c in gathers)!r}' in emit_jax(
        searched, "jax-mlp"
    )
    pp = emit_jax(make_plan("jax-mlp", "pp", schedule="1f1b"), "jax-mlp")
    # the plan's action lists (search/schedule.pipeline_actions), the loss stage's F and B included
    assert "SCHEDULE = [" in pp and '("F", 0, 0), ("F", 1, 0), ("F", 0, 1), ("B", 1, 0)' in pp
    uneven = emit_jax(make_plan("jax-mlp", "uneven"), "jax-mlp")
    assert "shares=[1, 1, 2, 4]" in uneven
    inter = emit_jax(make_plan("jax-mlp", "pp", schedule="interleaved_1f1b"), "jax-mlp")
    assert "runs as plain 1F1B over its 2 stages" in inter


def test_searched_tp_plan_pins_its_activation_layouts() -> None:
    """From the plan's op strategies: every column-parallel linear's output leaves sharded on its last
    dim, row-parallel outputs replicated; repeated blocks get the first block's layouts."""
    plan = searched_plan("jax-gpt-tiny", **CASES["tp"])
    text = emit_jax(plan, "jax-gpt-tiny")
    ns: dict = {}
    exec(compile(text, "program_jax.py", "exec"), ns)
    pins, specs = ns["ACTIVATION_PINS"], ns["PARAM_SPECS"]
    column = [
        f.split(".", 1)[1].rsplit(".", 1)[0]
        for f, s in specs.items()
        if f.endswith("kernel") and tuple(s) == (None, "tp")
    ]
    row = [
        f.split(".", 1)[1].rsplit(".", 1)[0] for f, s in specs.items() if f.endswith("kernel") and tuple(s) == ("tp",)
    ]
    assert column and row and any(m.startswith("blocks_1.") for m in column)
    for m in column:
        assert tuple(pins[m][0][0]) == (None, None, "tp"), (m, pins[m])
    for m in row:
        assert tuple(pins[m][0][-1]) == (), (m, pins[m])
    assert not any("copied from" in n for n in ns["NOTES"])  # the plan names every block (SolverCosts.solution)
    assert ns["PREDICTED_COLLECTIVES"]["stage0"]  # the plan's tp collectives, carried into the program


def test_stages_with_different_shares_are_refused() -> None:
    plan = make_plan("jax-mlp", "uneven_pp")
    st = dataclasses.replace(plan.stages[1], batch_shares=(2, 2))
    with pytest.raises(PlanError, match="splits micro-batches"):
        emit_jax(dataclasses.replace(plan, stages=(plan.stages[0], st)), "jax-mlp")


def test_interleaved_with_virtual_stages_is_refused() -> None:
    """Issue 15 item 5: the program would run plain 1F1B under the interleaved (1/v bubble) price."""
    plan = make_plan("jax-mlp", "pp", schedule="interleaved_1f1b")
    with pytest.raises(PlanError, match="2 virtual stages"):
        emit_jax(dataclasses.replace(plan, num_virtual_stages=2), "jax-mlp")


def test_partial_parameter_placement_is_refused() -> None:
    plan = make_plan("jax-mlp", "tp")
    st = dataclasses.replace(plan.stages[0], param_placements={"params.fc1.kernel": ("R", "P")})
    with pytest.raises(PlanError, match="cannot lay out"):
        emit_jax(dataclasses.replace(plan, stages=(st,)), "jax-mlp")


def test_a_tp_degree_that_shards_nothing_is_stated_and_checked() -> None:
    """Issue 31: the JAX program states ``Stage.tp_shards_nothing`` as the torch program does, and its set-up
    (``train.check_tp_shards_nothing``, called by ``StageRun``) refuses a program that lays a parameter out
    on tp all the same; a stage that shards something says nothing."""
    from jax.sharding import PartitionSpec as P

    from partita.backends.jax.train import check_tp_shards_nothing

    plan = make_plan("jax-mlp", "tp")
    bare = dataclasses.replace(plan, stages=(dataclasses.replace(plan.stages[0], param_placements={}),))
    assert bare.stages[0].tp_shards_nothing and not plan.stages[0].tp_shards_nothing
    text = emit_jax(bare, "jax-mlp")
    assert "# plan.json: tp_shards_nothing." in text and "tp_shards_nothing=True," in text
    assert "tp_shards_nothing" not in emit_jax(plan, "jax-mlp")
    ns: dict = {}
    exec(compile(text, "program_jax.py", "exec"), ns)  # noqa: S102 - our emitted source
    assert ns["STAGES"][0]["tp_shards_nothing"] is True
    specs = ns["PARAM_SPECS"]
    assert all("tp" not in tuple(s) for s in specs.values()), specs  # the emitted layouts agree: nothing on tp
    check_tp_shards_nothing(0, specs)
    with pytest.raises(PlanError, match="tp shards nothing in stage 0"):
        check_tp_shards_nothing(0, {**specs, "params.fc1.kernel": P(None, "tp")})
