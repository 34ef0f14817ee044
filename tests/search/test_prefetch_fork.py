"""search/entry/prefetch.py's forks inherit OR-Tools' MIP wrapper (issue 35 item 10: cold compile time)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# a fresh process (nothing imported OR-Tools yet): the layer ILPs of a small graph in two workers, and
# a task beside, recording at each fork whether the parent held the solver's module
CODE = """
import os, sys
seen = []
os.register_at_fork(before=lambda: seen.append("ortools.linear_solver.pywraplp" in sys.modules))
from partita.cluster import parse_cluster
from partita.search.entry import prefetch
from partita.search.layer.memo import IntraOpMemo
from partita.search.pipeline.stage_cost import SolverCosts
from partita.search.pricing.config import TrainingConfig
from tests.search.builders import gpt

g = gpt(2, 256, 4)
cl = parse_cluster("4xA100-80G")
costs = SolverCosts(g, cl, TrainingConfig(global_batch=8, seq_len=128), memo=IntraOpMemo())
dev = cl.device_types()[0]
prefetch.MIN_SOLVES = 1
n = prefetch.prefetch(costs, [(i, dev, tp, b) for i in range(len(g.layers)) for tp in (1, 2) for b in (1, 2)])
assert prefetch.in_background(lambda: 7)() == 7
print(n, seen)
"""


def test_workers_inherit_the_mip_solver() -> None:
    """Each forked worker imported the wrapper itself (~0.3 CPU s a fork, four or five forks per cold
    compile of a deep model); the parent now imports it once before it forks."""
    env = {**os.environ, "PARTITA_WORKERS": "2", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", CODE], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    solves, seen = out.stdout.split(" ", 1)
    assert int(solves) > 0
    assert seen.strip() == "[True, True, True]"  # two prefetch workers and the task beside
