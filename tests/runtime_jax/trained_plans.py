"""The JAX training matrix shared by ``test_jax_train_mlp.py`` and ``test_jax_train_gpt.py`` (one file per
model, so that the test run's workers, ``--dist loadfile``, train the two models side by side).

Per model, one subprocess on 8 JAX CPU devices (``run_programs.py``) trains 3 steps of every plan:
the search's own plans for forced shapes (``searched_plans.CASES``: DP, TP, DP x TP, ZeRO-1/2/3,
2-stage pipeline) and hand-made ones (``jax_plan_cases``: Megatron TP of the MLP, whose searched
TP plan replicates, uneven batch shares, and recompute). Losses and last-step gradients must match the
single-device reference (fp32, rtol 1e-4); for searched plans the collectives read from the
compiled HLO (plus the pipeline's stage-to-stage sends) must equal the plan's prediction per
``kind@axis`` in ops and bytes.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
from jax_plan_cases import make_plan
from searched_plans import CASES, searched_plan

from partita.backends.jax.emit import emit_jax
from partita.backends.jax.run import device_env
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


def write_plan(tmp: Path, name: str, plan: Plan, model: str) -> Path:
    d = tmp / name
    d.mkdir(parents=True, exist_ok=True)
    (d / "plan.json").write_text(plan.to_json())
    (d / "program_jax.py").write_text(emit_jax(plan, model))
    return d


def train_all(tmp: Path, model: str) -> Path:
    """Train every plan of ``model`` (searched and hand) in one subprocess; the folder of the results."""
    dirs = [str(write_plan(tmp, f"searched_{n}", searched_plan(model, **CASES[n]), model)) for n in SEARCHED[model]]
    dirs += [str(write_plan(tmp, f"hand_{n}", make_plan(model, n), model)) for n in HAND[model]]
    proc = subprocess.run(
        [sys.executable, str(HERE / "run_programs.py"), str(STEPS), str(tmp), *dirs],
        env=device_env(8),
        capture_output=True,
        text=True,
        timeout=500,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return tmp


def _load(tmp: Path, name: str) -> tuple[dict, dict, dict]:
    res = json.loads((tmp / f"{name}.json").read_text())
    return res, dict(np.load(tmp / f"{name}_grads.npz")), dict(np.load(tmp / f"{name}_params.npz"))


def check_matches_single_device(tmp: Path, name: str) -> None:
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


def check_searched_plan_collectives_equal_hlo(tmp: Path, model: str, name: str) -> None:
    res = json.loads((tmp / f"searched_{name}.json").read_text())
    assert res["collective_mismatches"] == {s: [] for s in res["collectives"]}
    pred = res["predicted_collectives"]
    measured = {k for s in res["collectives"].values() for k in s}
    assert measured == {k for s in pred.values() for k in s}
    want = MUST_HAVE.get(name, set()) | (MUST_HAVE_GPT.get(name, set()) if model == "jax-gpt-tiny" else set())
    assert want <= measured, (want, measured)
    if name == "zero3":  # one gather and one reduce-scatter per dp-sharded tensor and micro-batch
        stage = res["collectives"]["stage0"]
        assert stage["all-gather@dp"]["ops"] == stage["reduce-scatter@dp"]["ops"] > 2


def check_hand_plan_hlo_follows_layout(tmp: Path, model: str) -> None:
    """Hand plans predict nothing; their HLO must still show the layout: Megatron TP and uneven DP."""
    uneven = json.loads((tmp / "hand_uneven.json").read_text())["collectives"]["stage0"]
    assert set(uneven) == {"all-reduce@dp"} and uneven["all-reduce@dp"]["ops"] == 1  # one gradient sync
    if model == "jax-mlp":  # fc1 column-, fc2 row-parallel: one forward all-reduce of (8, 64) per micro-batch
        tp = json.loads((tmp / "hand_tp.json").read_text())["collectives"]["stage0"]
        assert tp == {"all-reduce@tp": {"ops": 2, "bytes": 2 * 8 * 64 * 4}}
