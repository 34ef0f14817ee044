"""Issue 19: every pipeline schedule on a heterogeneous pipeline (stages of different tensor
parallelism, a hand layout ``--tp 2,1,1``) rehearses its plan: the emitted program at full world size on
a fake process group, compared with the plan's records (``backends/torch/rehearse.py``). In its own file
so that the test run's workers (``--dist loadfile``) share it out beside ``test_rehearse.py``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from partita.backends.torch import rehearse
from partita.cli import main as cli_main
from partita.plan import Plan


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved_1f1b", "zb_h1", "zbv"])
def test_every_schedule_rehearses_a_heterogeneous_pipeline(
    schedule: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 19: each schedule on a pipeline whose stages differ in tensor parallelism (``--tp 2,1,1``:
    stage 0 on 2 ranks, then two 1-rank stages; a 6-block GPT-2 of width 256, 4 CPU ranks) rehearses
    its plan: tp and p2p records, peak memory per rank group, FLOPs. Three faults this found: interleaved
    1F1B priced every position at the first stage's count of a shallower pipeline (+15.8% / +25.5% on
    the middle and last rank groups of 3), the records of a chunk holding only the embedding scaled its
    tp bytes by its boolean mask's item size (4x), and the rehearsal gave a tp rank group's tied wte /
    lm_head two tensors where the program keeps one (+10.9%)."""
    monkeypatch.setenv("PARTITA_CACHE_DIR", str(tmp_path / "cache"))
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"model_type": "gpt2", "n_embd": 256, "n_layer": 6, "n_head": 4, "vocab_size": 256}))
    out = tmp_path / "plan"
    args = ["compile", str(cfg), "--cluster", "4xCPU", "--global-batch", "8", "--seq", "64", "--tp", "2,1,1"]
    args += ["--pp", "3", "--dp", "1", "--micro-batch", "1", "--schedule", schedule, "--out", str(out)]
    assert cli_main(args) == 0
    plan = Plan.from_json((out / "plan.json").read_text())
    groups = {s.ranks: s.tp for s in plan.stages}
    assert plan.schedule == schedule and groups == {(0, 1): 2, (2,): 1, (3,): 1}
    res = rehearse.rehearse_dir(out)
    assert res["match"], [(s["index"], s["mismatches"]) for s in res["stages"]]
    assert any("all_reduce@tp" in s["collectives"] for s in res["stages"])  # the tp rank group runs tp
