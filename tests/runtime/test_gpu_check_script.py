"""scripts/gpu_check.sh on a machine without CUDA: it says which GPU parts it skipped, runs the same
compile + run path on the CPU (the run's per-step log line included) and exits 0 (~1 minute)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU path runs only without CUDA")
def test_gpu_check_cpu_path() -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--no-install"],
        capture_output=True, text=True, env=env, timeout=600, cwd=ROOT,
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "skipped the GPU parts" in out and "CPU path ok" in out
    line = next(ln for ln in out.splitlines() if "CPU path ok" in ln)
    for part in ("step 2/2", "loss ", "tok/s", "predicted", "MFU"):
        assert part in line, line
