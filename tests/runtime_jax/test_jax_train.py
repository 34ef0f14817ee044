"""End to end: generated JAX programs train like one device, and XLA compiles the plan's collectives.

Per model, one subprocess on 8 JAX CPU devices (``run_programs.py``) trains 3 steps of every plan:
the search's own plans for forced shapes (``searched_plans.CASES``: DP, TP, DP x TP, ZeRO-1/2/3,
2-stage pipeline) and hand-made ones (``jax_plan_cases``: Megatron TP of the MLP, whose searched
TP plan replicates, uneven batch shares, and recompute). Losses and last-step gradients must match the
single-device reference (fp32, rtol 1e-4); for searched plans the collectives read from the
compiled HLO (plus the pipeline's stage-to-stage sends) must equal the plan's prediction per
``kind@axis`` in ops and bytes. The CLI path (`partita compile` + `partita run --reference`) and a
2-process ``jax.distributed`` run are tested on their own.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from jax_plan_cases import make_plan
from searched_plans import CASES, searched_plan

from partita.backends.jax.emit import emit_jax
from partita.backends.jax.run import device_env, run
from partita.plan import Plan

HERE = Path(__file__).parent
STEPS = 3
RTOL = 1e-4
HAND = {"jax-mlp": ("tp", "uneven", "uneven_pp"), "jax-gpt-tiny": ("uneven", "dp_tp_remat", "interleaved")}
SEARCHED = {"jax-mlp": tuple(CASES), "jax-gpt-tiny": ("dp", "tp", "dp_tp", "zero3", "pp")}
# What each searched layout must show in its HLO (beyond matching the prediction exactly).
MUST_HAVE = {
    "dp": {"all-reduce@dp"},
    "dp_tp": {"all-reduce@dp"},
    "zero1": {"reduce-scatter@dp", "all-gather@dp"},
    "zero2": {"reduce-scatter@dp", "all-gather@dp"},
    "zero3": {"reduce-scatter@dp", "all-gather@dp"},
    "pp": {"all-reduce@dp", "p2p@pp"},
}
MUST_HAVE_GPT = {"tp": {"all-reduce@tp", "all-gather@tp"}, "dp_tp": {"all-reduce@tp", "all-reduce@dp"}}


def _write(tmp: Path, name: str, plan: Plan, model: str) -> Path:
    d = tmp / name
    d.mkdir(parents=True, exist_ok=True)
    (d / "plan.json").write_text(plan.to_json())
    (d / "program_jax.py").write_text(emit_jax(plan, model))
    return d


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """model -> the folder where its plans were trained (once per model, in one subprocess)."""
    done: dict[str, Path] = {}

    def get(model: str) -> Path:
        if model not in done:
            tmp = tmp_path_factory.mktemp(model)
            dirs = [str(_write(tmp, f"searched_{n}", searched_plan(model, **CASES[n]), model)) for n in SEARCHED[model]]
            dirs += [str(_write(tmp, f"hand_{n}", make_plan(model, n), model)) for n in HAND[model]]
            proc = subprocess.run(
                [sys.executable, str(HERE / "run_programs.py"), str(STEPS), str(tmp), *dirs],
                env=device_env(8),
                capture_output=True,
                text=True,
                timeout=500,
            )
            assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
            done[model] = tmp
        return done[model]

    return get


def _load(tmp: Path, name: str) -> tuple[dict, dict, dict]:
    res = json.loads((tmp / f"{name}.json").read_text())
    return res, dict(np.load(tmp / f"{name}_grads.npz")), dict(np.load(tmp / f"{name}_params.npz"))


ALL = [(m, f"searched_{n}") for m, ns in SEARCHED.items() for n in ns]
ALL += [(m, f"hand_{n}") for m, ns in HAND.items() for n in ns]


@pytest.mark.parametrize("model,name", ALL)
def test_matches_single_device(trained: Callable[[str], Path], model: str, name: str) -> None:
    tmp = trained(model)
    res, grads, params = _load(tmp, name)
    ref, ref_grads, ref_params = _load(tmp, f"{res['reference']}_reference")
    assert len(res["losses"]) == STEPS and res["losses"][-1] < res["losses"][0]
    np.testing.assert_allclose(res["losses"], ref["losses"], rtol=RTOL)
    assert sorted(grads) == sorted(ref_grads)
    for fqn in grads:  # gradients at the last step (after 2 updates), every parameter
        # rtol per element, and the same 1e-4 against the tensor's largest entry: after two Adam
        # steps, fp32 reduction-order noise (~1e-7) dominates entries near zero.
        scale = float(np.max(np.abs(ref_grads[fqn])))
        np.testing.assert_allclose(grads[fqn], ref_grads[fqn], rtol=RTOL, atol=RTOL * scale, err_msg=fqn)
        # Adam turns tiny gradient noise into +-lr steps where a gradient is ~0: params only to ~lr.
        np.testing.assert_allclose(params[fqn], ref_params[fqn], atol=2e-3, err_msg=fqn)


@pytest.mark.parametrize("model,name", [(m, n) for m, ns in SEARCHED.items() for n in ns])
def test_searched_plan_collectives_equal_hlo(trained: Callable[[str], Path], model: str, name: str) -> None:
    res = json.loads((trained(model) / f"searched_{name}.json").read_text())
    assert res["collective_mismatches"] == {s: [] for s in res["collectives"]}
    pred = res["predicted_collectives"]
    measured = {k for s in res["collectives"].values() for k in s}
    assert measured == {k for s in pred.values() for k in s}
    want = MUST_HAVE.get(name, set()) | (MUST_HAVE_GPT.get(name, set()) if model == "jax-gpt-tiny" else set())
    assert want <= measured, (want, measured)
    if name == "zero3":  # one gather and one reduce-scatter per dp-sharded tensor and micro-batch
        stage = res["collectives"]["stage0"]
        assert stage["all-gather@dp"]["ops"] == stage["reduce-scatter@dp"]["ops"] > 2


@pytest.mark.parametrize("model", list(HAND))
def test_hand_plan_hlo_follows_layout(trained: Callable[[str], Path], model: str) -> None:
    """Hand plans predict nothing; their HLO must still show the layout: Megatron TP and uneven DP."""
    tmp = trained(model)
    uneven = json.loads((tmp / "hand_uneven.json").read_text())["collectives"]["stage0"]
    assert set(uneven) == {"all-reduce@dp"} and uneven["all-reduce@dp"]["ops"] == 1  # one gradient sync
    if model == "jax-mlp":  # fc1 column-, fc2 row-parallel: one forward all-reduce of (8, 64) per micro-batch
        tp = json.loads((tmp / "hand_tp.json").read_text())["collectives"]["stage0"]
        assert tp == {"all-reduce@tp": {"ops": 2, "bytes": 2 * 8 * 64 * 4}}


@pytest.mark.slow
def test_cli_compile_and_run(tmp_path: Path) -> None:
    """`partita compile jax-gpt-tiny --cluster 8xCPU ... && partita run DIR --steps 3 --reference --json`."""
    out = tmp_path / "gpt"
    env = device_env(1) | {"PARTITA_CACHE_DIR": str(tmp_path / "cache")}
    args = ["--cluster", "8xCPU", "--global-batch", "16", "--seq", "32", "--dtype", "f32", "--out", str(out)]
    subprocess.run(["partita", "compile", "jax-gpt-tiny", *args], check=True, env=env, capture_output=True)
    proc = subprocess.run(
        ["partita", "run", str(out), "--steps", "3", "--reference", "--json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout)
    np.testing.assert_allclose(res["losses"], res["reference_losses"], rtol=RTOL)
    assert res["collective_mismatches"] == {s: [] for s in res["collectives"]} and res["collectives"]["stage0"]
    assert res["max_grad_diff"] < 1e-5


def test_run_prints_interleaved_fallback(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The launcher path (`partita run DIR --reference`): an interleaved plan runs as 1F1B and says so."""
    plan = make_plan("jax-mlp", "pp", schedule="interleaved_1f1b")
    d = _write(tmp_path, "pp", plan, "jax-mlp")
    res = run(d, steps=2, reference=True)
    np.testing.assert_allclose(res["losses"], res["reference_losses"], rtol=RTOL)
    assert res["max_grad_diff"] < 1e-5
    assert any("runs as plain 1F1B" in n for n in res["notes"])
    assert "runs as plain 1F1B" in capsys.readouterr().err
    assert res["collectives"]["stage0"]["p2p@pp"]["ops"] == plan.num_micro_batches


@pytest.mark.multiprocess
def test_two_process_distributed(tmp_path: Path) -> None:
    """jax.distributed with 2 CPU processes x 4 devices trains the search's DP x TP plan like one device."""
    plan = searched_plan("jax-gpt-tiny", **CASES["dp_tp"])
    d = _write(tmp_path, "dp_tp", plan, "jax-gpt-tiny")
    res = run(d, steps=STEPS, reference=True, num_processes=2)
    assert res["num_processes"] == 2 and res["num_devices"] == 8
    np.testing.assert_allclose(res["losses"], res["reference_losses"], rtol=RTOL)
    assert res["max_grad_diff"] < 1e-5
    assert res["collective_mismatches"] == {"stage0": []}


@pytest.mark.parametrize("name", ["zero3", "pp"])
def test_rehearsal_compiles_what_the_run_compiled(trained: Callable[[str], Path], name: str) -> None:
    """``partita rehearse`` on a JAX plan (``backends/jax/rehearse.py``: the step lowered and compiled
    on abstract inputs, nothing allocated) sees exactly the collectives the real run compiled and sent,
    per stage, ``kind@axis``, ops and bytes. Its FLOPs (XLA's cost analysis) are the plan's within 10%:
    XLA also counts element-wise ops and the Adam update, which the plan's FLOPs (matmuls, as torch's
    flop counter) leave out, +5.5% on this tiny GPT's pipeline stage (h=64); at real sizes matmuls dominate."""
    from partita.backends.jax.fidelity import PLAN_KINDS
    from partita.driver import rehearse

    tmp = trained("jax-gpt-tiny")
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
