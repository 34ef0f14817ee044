"""Issue 15 on JAX: the plan's records are exactly the collectives XLA compiles for the JAX program.

The search's own plans (``searched_plans.searched_plan``: ZeRO-3 over dp 8 in bf16, a 2-stage pipeline
with dp 2 x tp 2 in bf16, plain dp in bf16, tp 8 at seq 32) are emitted and rehearsed
(``backends/jax/rehearse.py``: every stage function lowered and compiled by XLA at 8 devices on abstract
inputs; all in one subprocess) and compared with ``Stage.collectives`` (``search/program/jax_records.py``) by the rule of
``partita rehearse`` (``backends/torch/rehearse.compare_stage``: counts equal, bytes within 2%). Every
``kind@axis`` must match: the ZeRO-3 parameter all-gathers and per-tensor reduce-scatters are recorded,
a bf16 plan's gradient sync is recorded in f32, the dtype the program's gradients have, and a tp
stage's collectives are the ILP's, per micro-batch (the f32 tp plans at seq 16 are checked against the
HLO of their real run by ``test_jax_train_gpt.test_searched_plan_collectives_equal_hlo``). Memory and
FLOPs are compared too but not asserted here: they are the cost model's (``search/pipeline/stage_cost.py``).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from searched_plans import CASES, searched_plan

from partita.backends.jax.emit import emit_jax
from partita.backends.jax.run import device_env
from partita.backends.torch.rehearse import RankResult, compare_stage
from partita.plan import Plan

MODEL = "jax-gpt-tiny"
# name -> (searched_plans case, dtype, seq)
RUNS = {
    "zero3_bf16": ("zero3", "bf16", 16),
    "pp_bf16": ("pp", "bf16", 16),
    "dp_bf16": ("dp", "bf16", 16),
    "tp_seq32": ("tp", "f32", 32),
}
# At seq 32 the ILP shards the loss region over the sequence on tp; XLA's SPMD partitioner realizes it with
# other collectives than the ILP's resharding (a scalar all-reduce of the partial loss in place of the
# ILP's all-gather of the per-token loss, and one more backward all-gather of the logits' gradient per
# micro-batch), so the records miss them (search/program/jax_records.py says so). Strict: it fails once they agree.
GAPS = {"tp_seq32"}


@pytest.fixture(scope="module")
def rehearsed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Plan, dict]]:
    tmp = tmp_path_factory.mktemp("rehearse")
    plans, args = {}, []
    for name, (case, dtype, seq) in RUNS.items():
        plan = searched_plan(MODEL, **CASES[case], dtype=dtype, seq=seq)
        (tmp / f"{name}.py").write_text(emit_jax(plan, MODEL))
        plans[name] = plan
        args += [str(tmp / f"{name}.py"), str(tmp / f"{name}.json")]
    proc = subprocess.run(
        [sys.executable, "-m", "partita.backends.jax.rehearse", *args],
        env=device_env(8),
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return {n: (plans[n], json.loads((tmp / f"{n}.json").read_text())["rehearsal"]) for n in RUNS}


def _compared(plan: Plan, got: dict) -> list[dict]:
    out = []
    for s in plan.stages:  # as driver._rehearse_jax sets them side by side
        r = got[f"stage{s.index}"]
        res = RankResult(
            s.ranks[0], s.index, r["collectives"], int(r["peak_memory_bytes"]), r["memory_by_category"], int(r["flops"])
        )
        out.append(compare_stage(s, [res]))
    return out


@pytest.mark.parametrize(
    "name",
    [
        pytest.param(n, marks=pytest.mark.xfail(strict=True, reason="XLA's own tp resharding at seq 32 (GAPS)"))
        if n in GAPS
        else n
        for n in RUNS
    ],
)
def test_records_are_what_xla_compiles(rehearsed: dict[str, tuple[Plan, dict]], name: str) -> None:
    plan, got = rehearsed[name]
    for st in _compared(plan, got):
        colls = [m for m in st["mismatches"] if not m.startswith(("memory:", "flops:"))]
        assert colls == [], (name, st["index"], colls)
        assert {k: v["count"] for k, v in st["collectives"].items()} == {
            k: v["count"] for k, v in st["planned_collectives"].items()
        }
        assert st["collectives"], (name, st["index"])  # every case moves something


def test_zero3_gathers_and_f32_sync_are_recorded(rehearsed: dict[str, tuple[Plan, dict]]) -> None:
    """ZeRO-3: one all-gather and one reduce-scatter per parameter tensor and micro-batch, both recorded;
    bf16 dp: the gradient all-reduce moves f32 gradients (4 bytes per parameter), as recorded."""
    plan, got = rehearsed["zero3_bf16"]
    st = plan.stages[0]
    kinds = {(c.kind, c.axis) for c in st.collectives}
    assert {("all_gather", "dp"), ("reduce_scatter", "dp")} <= kinds
    per_tensor = [c for c in st.collectives if c.kind == "all_gather"]
    assert len(per_tensor) > 2 and all(c.count == plan.num_micro_batches for c in per_tensor)
    assert got["stage0"]["collectives"]["all_gather@dp"]["count"] == len(per_tensor) * plan.num_micro_batches
    plan, got = rehearsed["dp_bf16"]
    (sync,) = [c for c in plan.stages[0].collectives if c.axis == "dp"]  # one flat bucket per step
    assert plan.training["dtype"] == "bf16" and sync.count == 1
    assert sync.bytes == 4 * plan.model["num_params"]  # f32 gradients of every parameter
    assert got["stage0"]["collectives"]["all_reduce@dp"] == {"count": 1, "bytes": pytest.approx(sync.bytes)}
