"""End to end: generated JAX programs train like one device, and XLA compiles the plan's collectives.

The training matrix (every searched and hand plan of each model, one subprocess per model) is in
``test_jax_train_mlp.py`` and ``test_jax_train_gpt.py`` (helpers in ``trained_plans.py``), one file per
model so that the test run's workers (``--dist loadfile``) train them side by side. Here: the CLI path
(`partita compile` + `partita run --reference`) and a 2-process ``jax.distributed`` run.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest
from searched_plans import CASES, searched_plan
from trained_plans import RTOL, STEPS, write_plan

from partita.backends.jax.run import device_env, run


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


@pytest.mark.multiprocess
def test_two_process_distributed(tmp_path: Path) -> None:
    """jax.distributed with 2 CPU processes x 4 devices trains the search's DP x TP plan like one device."""
    plan = searched_plan("jax-gpt-tiny", **CASES["dp_tp"])
    d = write_plan(tmp_path, "dp_tp", plan, "jax-gpt-tiny")
    res = run(d, steps=STEPS, reference=True, num_processes=2)
    assert res["num_processes"] == 2 and res["num_devices"] == 8
    np.testing.assert_allclose(res["losses"], res["reference_losses"], rtol=RTOL)
    assert res["max_grad_diff"] < 1e-5
    assert res["collective_mismatches"] == {"stage0": []}
