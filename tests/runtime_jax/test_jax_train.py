"""End to end: generated JAX programs train like a single device, and their HLO has the layout's collectives.

Each model's five plans (DP, Megatron TP, DP x TP, ZeRO-3, 2-stage pipeline) run in one subprocess on
8 JAX CPU devices (``run_programs.py``); the plain ``partita.runtime.jax_run.run`` path and the
2-process ``jax.distributed`` path are tested on their own. Expected collective counts are derived
here from the layouts (sizes: micro-batch 8 samples, 2 micro-batches, seq 16, hidden 64).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from jax_plan_cases import NUM_MICRO_BATCHES, make_plan

from partita.compiler.emit_jax import emit_jax
from partita.runtime.jax_run import device_env, run

HERE = Path(__file__).parent
LAYOUTS = ("dp", "tp", "dp_tp", "zero3", "pp")
STEPS = 3
RTOL = 1e-4


def _write(tmp: Path, model: str, layout: str, **kw: str) -> Path:
    plan = make_plan(model, layout, **kw)
    d = tmp / f"{model}_{layout}"
    d.mkdir(parents=True, exist_ok=True)
    (d / "plan.json").write_text(plan.to_json())
    (d / "program_jax.py").write_text(emit_jax(plan, model))
    return d


@pytest.fixture(scope="module", params=["jax-mlp", "jax-gpt-tiny"])
def trained(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    model = request.param
    tmp = tmp_path_factory.mktemp(model)
    dirs = [str(_write(tmp, model, lay)) for lay in LAYOUTS]
    proc = subprocess.run(
        [sys.executable, str(HERE / "run_programs.py"), str(STEPS), str(tmp), *dirs],
        env=device_env(8),
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return model, tmp


def _load(tmp: Path, name: str) -> tuple[dict, dict, dict]:
    res = json.loads((tmp / f"{name}.json").read_text())
    return res, dict(np.load(tmp / f"{name}_grads.npz")), dict(np.load(tmp / f"{name}_params.npz"))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_matches_single_device(trained: tuple[str, Path], layout: str) -> None:
    model, tmp = trained
    res, grads, params = _load(tmp, f"{model}_{layout}")
    ref, ref_grads, ref_params = _load(tmp, f"{model}_reference")
    assert len(res["losses"]) == STEPS and res["losses"][-1] < res["losses"][0]
    np.testing.assert_allclose(res["losses"], ref["losses"], rtol=RTOL)
    assert sorted(grads) == sorted(ref_grads)
    for fqn in grads:  # gradients at the last step (after 2 updates), every parameter
        scale = float(np.max(np.abs(ref_grads[fqn])))
        np.testing.assert_allclose(grads[fqn], ref_grads[fqn], rtol=RTOL, atol=1e-5 * scale, err_msg=fqn)
        # Adam turns tiny gradient noise into +-lr steps where a gradient is ~0: params only to ~lr.
        np.testing.assert_allclose(params[fqn], ref_params[fqn], atol=2e-3, err_msg=fqn)


def _hlo(tmp: Path, name: str) -> dict:
    return json.loads((tmp / f"{name}.json").read_text())["hlo_collectives"]


def test_hlo_collectives_follow_layout(trained: tuple[str, Path]) -> None:
    model, tmp = trained
    gpt = model == "jax-gpt-tiny"
    m = NUM_MICRO_BATCHES
    num_params = 0
    for _f, g in np.load(tmp / f"{model}_reference_grads.npz").items():
        num_params += g.size
    num_tensors = len(np.load(tmp / f"{model}_reference_grads.npz").files)
    # DP: every gradient all-reduced over dp once per micro-batch (+ the loss mean), nothing else.
    dp = _hlo(tmp, f"{model}_dp")["0"]
    assert dp["by_axis"] == {"all-reduce@dp": dp["all-reduce"]}
    assert dp["all-gather"] == dp["all-to-all"] == dp["collective-permute"] == dp["reduce-scatter"] == 0
    assert dp["by_phase"] == {"all-reduce@backward": m * num_tensors, "all-reduce@forward": m}
    # XLA reduces only the wpe rows the sequence uses (16 of the table's 32 rows).
    unused = (32 - 16) * 64 if gpt else 0
    assert dp["elements"]["all-reduce"] == m * (num_params - unused + 1)
    # Megatron TP: activation all-reduces over tp only (row-parallel output forward, column-parallel
    # input gradient backward), no gradient sync. MLP: fc2 forward only (the input needs no gradient).
    tp = _hlo(tmp, f"{model}_tp")["0"]
    act = (8, 16, 64) if gpt else (8, 64)
    fwd, bwd = (2 * m, 2 * m) if gpt else (m, 0)
    assert set(tp["by_axis"]) == {"all-reduce@tp"}
    assert tp["by_phase"] == {"all-reduce@forward": fwd} | ({"all-reduce@backward": bwd} if bwd else {})
    assert tp["elements"]["all-reduce"] == (fwd + bwd) * int(np.prod(act))
    # DP x TP: the same tp activation all-reduces on half the batch, plus the gradient sync over dp.
    dptp = _hlo(tmp, f"{model}_dp_tp")["0"]
    assert set(dptp["by_axis"]) == {"all-reduce@tp", "all-reduce@dp"}
    assert dptp["by_axis"]["all-reduce@dp"] >= 1
    assert dptp["all-gather"] == dptp["all-to-all"] == 0
    # ZeRO-3: parameters all-gathered over dp inside the step; still no tp traffic.
    z3 = _hlo(tmp, f"{model}_zero3")["0"]
    assert {k.split("@")[1] for k in z3["by_axis"]} == {"dp"}
    assert z3["by_axis"]["all-gather@dp"] >= num_tensors and z3["by_axis"]["all-reduce@dp"] >= 1
    assert z3["elements"]["all-gather"] >= num_params - unused  # every parameter gathered at least once
    # Pipeline: no collective between stages (device_put transfers); each stage syncs its own grads.
    pp = _hlo(tmp, f"{model}_pp")
    assert set(pp) == {"0", "1"}
    for s in pp.values():
        assert s["by_axis"].get("all-reduce@dp", 0) >= 1 and "collective-permute@dp" not in s["by_axis"]
        assert set(s["functions"]) <= {"forward", "backward", "update"}


def test_run_reports_losses_and_collectives(tmp_path: Path) -> None:
    """The launcher path (`partita run DIR --reference`): 1F1B pipeline of the MLP, subprocess."""
    d = _write(tmp_path, "jax-mlp", "pp", schedule="1f1b")
    res = run(d, steps=2, reference=True)
    np.testing.assert_allclose(res["losses"], res["reference_losses"], rtol=RTOL)
    assert res["max_grad_diff"] < 1e-5
    assert set(res["hlo_collectives"]) == {"0", "1"}
    assert res["collective_check"]["0"]["all-reduce"]["predicted"] is None  # hand plan: no predictions
    assert res["hlo_collectives"]["0"]["functions"]["forward"]["by_axis"] == {"all-gather@tp": 1}


@pytest.mark.multiprocess
def test_two_process_distributed(tmp_path: Path) -> None:
    """jax.distributed with 2 CPU processes x 4 devices trains DP x TP like one device."""
    d = _write(tmp_path, "jax-mlp", "dp_tp")
    res = run(d, steps=STEPS, reference=True, num_processes=2)
    assert res["num_processes"] == 2 and res["num_devices"] == 8
    np.testing.assert_allclose(res["losses"], res["reference_losses"], rtol=RTOL)
    assert res["max_grad_diff"] < 1e-5
