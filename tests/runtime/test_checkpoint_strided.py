"""DCP checkpoints of strided shards (a plan's ``"SS(d,g)"``) load under every other layout.

A ``_StridedShard`` is not a box of its tensor, so ``backends/torch/checkpoint.py`` saves it as the view
that makes it one. Two gloo ranks save a weight and its Adam state under each of five layouts
(strided, contiguous column shard, row shard, replicated, plain tensor) and load every checkpoint
under every layout: the full weight and ``exp_avg`` must come back exactly.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.multiprocess
ROOT = Path(__file__).resolve().parents[2]


def test_every_layout_pair_round_trips(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    env |= {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    worker = ROOT / "tests" / "runtime" / "strided_checkpoint_worker.py"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(worker)]
    proc = subprocess.run([*cmd, str(tmp_path)], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [ln.split() for ln in proc.stdout.splitlines() if "->" in ln]
    assert len(lines) == 25, proc.stdout
    bad = [ln for ln in lines if ln[3:] != ["True", "True"]]
    assert not bad, bad
