"""``partita run --reference`` checks every parameter against one device (issue 31, ``backends/torch/parity.py``).

One tiny Llama (``families.tiny("llama")``), compiled in f32 as a hand layout tp=2 x dp=2 on 4 CPU ranks
(sequence 64: at 16 the layer ILP keeps every module whole at f32, and there would be no all-reduce to
drop), run twice for 2 steps: as compiled (exit 0, every step-1 gradient and final parameter within the
f32 tolerance, collectives equal to the plan's records), and with layer 1's ``down_proj`` forward
all-reduce dropped (``tp.DROP_ENV``, a test-only hook in the program's runtime): exit 1, the dropped
module's weight named among the parameters that differ, the step-1 gradients first in the table of the
worst parameters, the collective mismatch reported (``--json``; without it the CLI prints
``parity.verdict`` alone, no loss lines).

Why the old test saw only ``lm_head.weight``: it compiled without ``--dtype``, so the plan ran bf16 and was
judged at bf16's tolerance (5e-2 relative, 1e-3 absolute), under which only the LM head's step-1
gradient (8e-2 relative) stood out. In f32 every parameter differs: the dropped all-reduce halves layer
1's MLP output, the loss changes, and every step-1 gradient moves by 2-10% relative (the final norm and
the LM head most, the dropped ``down_proj`` 2.3%): no gradient singles the module out, so the check names
them all, and the collective mismatch (``all_reduce@tp: measured 14, predicted 16``) says which kind went
missing.
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
    layout = ["--tp", "2", "--pp", "1", "--dp", "2", "--micro-batch", "2", "--dtype", "f32"]
    got = _cli(
        "compile", spec, "--cluster", "4xCPU", "--global-batch", "8", "--seq", "64", *layout, "--out", str(out), env=env
    )
    assert got.returncode == 0, got.stderr
    plan = json.loads((out / "plan.json").read_text())
    assert plan["stages"][0]["tp_plan"].get(DROPPED) == "rowwise", "the plan must shard it, row-parallel"

    good = _cli("run", str(out), "--steps", "2", "--reference", env=env)
    assert good.returncode == 0, good.stdout + good.stderr
    assert "every parameter matches the single-device run" in good.stdout

    bad = _cli("run", str(out), "--steps", "2", "--reference", "--json", env={**env, tp.DROP_ENV: DROPPED})
    assert bad.returncode == 1, bad.stdout + bad.stderr
    par = json.loads(bad.stdout)["parity"]
    assert not par["ok"] and par["failing"], par
    text = verdict(par)  # what the command prints without --json, and nothing else
    assert "differ from the single-device run" in text and "max abs diff" in text
    assert par["dtype"] == "f32" and f"{DROPPED}.weight" in par["failing"], par["failing"]
    assert f"{DROPPED}.weight" in text  # named, with every other parameter that differs
    rows = text.splitlines()[2:12]  # the table: failing step-1 gradients first, the evidence
    assert all(r.startswith("grad@1") and r.endswith("NO") for r in rows), text
    assert "collectives issued differ from the plan's records" in text and "all_reduce@tp" in text
