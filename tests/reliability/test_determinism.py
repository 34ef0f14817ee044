"""Determinism: the same inputs give a byte-identical plan.json (and program, report) across runs
and processes.

Two ``partita compile`` processes run side by side with different compile caches (so neither is a
cache hit) and different ``PYTHONHASHSEED`` (so set and dict-of-set iteration order differs), on
a mixed cluster whose plan splits each micro-batch unevenly between H100 and A100 replicas.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ARGS = ("compile", "gpt2-tiny", "--cluster", "4xH100-80G+4xA100-80G", "--global-batch", "1024", "--seq", "32")
FILES = ("plan.json", "program_torch.py", "report.txt")


def test_plan_bytes_identical_across_processes(tmp_path: Path) -> None:
    procs = []
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed, "PARTITA_CACHE_DIR": str(tmp_path / f"cache{seed}")}
        env |= {"OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])}
        cmd = [sys.executable, "-m", "partita.cli", *ARGS, "--out", str(tmp_path / f"out{seed}")]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-2000:]
    for name in FILES:
        first = (tmp_path / "out1" / name).read_bytes()
        assert first == (tmp_path / "out2" / name).read_bytes(), name
    plan = (tmp_path / "out1" / "plan.json").read_text()
    assert '"mixed"' in plan  # the interesting case: per-replica shares on two device types
    assert not list((tmp_path / "cache1" / "plans").glob("*/*.tmp*"))  # cache entries published whole
