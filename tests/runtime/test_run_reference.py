"""``partita run --reference`` checks every parameter against one device (issue 31, ``backends/torch/parity.py``).

One tiny Llama (``families.tiny("llama")``), compiled as a hand layout tp=2 x dp=2 on 4 CPU ranks, run
twice for 2 steps: as compiled (exit 0, every step-1 gradient and final parameter within the f32
tolerance, collectives equal to the plan's records), and with one row module's forward all-reduce
dropped (``tp.DROP_ENV``, a test-only hook in the program's runtime): exit 1, the failing parameters
named in the table of the worst parameters, the collective
mismatch reported (``--json``; without it the CLI prints ``parity.verdict`` alone, no loss lines).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from partita.backends.torch import tp
from partita.backends.torch.parity import verdict
from partita.models import families

ROOT = Path(__file__).resolve().parents[2]
DROPPED = "model.layers.1.mlp.down_proj"


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    full = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), **(env or {})}
    cmd = [sys.executable, "-m", "partita.cli", *args]
    return subprocess.run(cmd, env=full, cwd=ROOT, capture_output=True, text=True, timeout=400)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_reference_fails_a_broken_layout_naming_the_parameter(tmp_path: Path) -> None:
    spec = str(families.write_config(tmp_path / "llama", families.tiny("llama")))
    out = tmp_path / "plan"
    env = {"PARTITA_CACHE_DIR": str(tmp_path / "cache")}
    layout = ["--tp", "2", "--pp", "1", "--dp", "2", "--micro-batch", "2"]
    got = _cli(
        "compile", spec, "--cluster", "4xCPU", "--global-batch", "8", "--seq", "16", *layout, "--out", str(out), env=env
    )
    assert got.returncode == 0, got.stderr
    plan = json.loads((out / "plan.json").read_text())
    assert any(k.startswith(DROPPED) for k in plan["stages"][0]["param_placements"]), "the plan must shard it"

    good = _cli("run", str(out), "--steps", "2", "--reference", env=env)
    assert good.returncode == 0, good.stdout + good.stderr
    assert "every parameter matches the single-device run" in good.stdout

    bad = _cli("run", str(out), "--steps", "2", "--reference", "--json", env={**env, tp.DROP_ENV: DROPPED})
    assert bad.returncode == 1, bad.stdout + bad.stderr
    par = json.loads(bad.stdout)["parity"]
    assert not par["ok"] and par["failing"], par
    text = verdict(par)  # what the command prints without --json, and nothing else
    assert "differ from the single-device run" in text and "max abs diff" in text
    assert all(name in text for name in par["failing"][:10])  # the table names the parameters that differ
    assert " NO" in text.splitlines()[2]  # the worst parameter first
    assert "collectives issued differ from the plan's records" in text and "all_reduce@tp" in text
