"""scripts/gpu_check.sh on a machine without CUDA: its stdout is one JSON line saying the GPU phases
were skipped, with the same compile + run path checked on the CPU (the run's per-step log line
included), and it exits 0 (~1 minute)."""

from __future__ import annotations

import json
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
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1, proc.stdout  # one JSON line on stdout; progress on stderr
    got = json.loads(lines[0])
    assert got["skipped"] == "no CUDA device" and "skipped" in proc.stderr
    cpu = got["cpu_path"]
    assert cpu["ok"] and cpu["exit_code"] == 0 and len(cpu["losses"]) == 2
    for part in ("step 2/2", "loss ", "tok/s", "predicted", "MFU"):
        assert part in cpu["step_line"], cpu["step_line"]
