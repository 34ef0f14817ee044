"""Compile driver: staged API, compile cache hits and misses, outputs written to DIR."""

import json

import pytest

from partita.driver import compile_to_dir, trace_model
from partita.plan import Plan
from partita.search.pricing.config import TrainingConfig


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PARTITA_CACHE_DIR", str(tmp_path / "cache"))


def test_cache_hit_and_misses(tmp_path) -> None:
    tc = TrainingConfig(global_batch=16, seq_len=32, dtype="f32")
    first = compile_to_dir("mlp", "4xCPU", tc, tmp_path / "a")
    assert not first.cache_hit
    plan_text = (tmp_path / "a" / "plan.json").read_text()
    assert Plan.from_json(plan_text).world_size <= 4
    for name in ("plan.json", "report.txt", "program_torch.py"):
        assert (tmp_path / "a" / name).exists()
    again = compile_to_dir("mlp", "4xCPU", tc, tmp_path / "b")
    assert again.cache_hit and again.elapsed_s < 1.0
    assert (tmp_path / "b" / "plan.json").read_text() == plan_text
    assert "cache hit" in again.as_text()
    assert not compile_to_dir("mlp", "4xCPU", tc, tmp_path / "c", force=True).cache_hit
    assert not compile_to_dir("mlp", "2xCPU", tc, tmp_path / "d").cache_hit
    assert not compile_to_dir(
        "mlp", "4xCPU", TrainingConfig(global_batch=32, seq_len=32, dtype="f32"), tmp_path / "e"
    ).cache_hit
    assert not compile_to_dir("gpt2-tiny", "4xCPU", tc, tmp_path / "f").cache_hit


def test_staged_api(tmp_path) -> None:
    traced = trace_model("mlp", batch=4, seq=32)
    assert "mlp" in traced.as_text(batch=4)
    summary = traced.summary(batch=4)
    assert summary["num_params"] == 32 * 64 + 64 + 64 * 8 + 8
    planned = traced.plan("4xCPU", TrainingConfig(global_batch=16, seq_len=32, dtype="f32"))
    assert "Stages" in planned.as_text()
    compiled = planned.compile(tmp_path / "out")
    assert json.loads((tmp_path / "out" / "plan.json").read_text())["format"] == "partita.plan"
    assert compiled.summary()["predicted_step_time_s"] > 0


def test_cache_hit_in_a_fresh_process_imports_no_torch(tmp_path) -> None:
    """`partita compile` on a hit serves plan + program from the cache entry: no trace, no torch."""
    import os
    import subprocess
    import sys

    tc = TrainingConfig(global_batch=16, seq_len=32, dtype="f32")
    first = compile_to_dir("mlp", "4xCPU", tc, tmp_path / "a")
    code = (
        "import sys, json\n"
        "from partita.driver import compile_to_dir\n"
        "from partita.search.pricing.config import TrainingConfig\n"
        f"c = compile_to_dir('mlp', '4xCPU', TrainingConfig(global_batch=16, seq_len=32, dtype='f32'), {str(tmp_path / 'b')!r})\n"
        "print(json.dumps({'hit': c.cache_hit, 'torch': 'torch' in sys.modules, 's': c.elapsed_s}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=dict(os.environ), check=True)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["hit"] and not got["torch"], got
    for name in ("plan.json", "program_torch.py"):
        assert (tmp_path / "b" / name).read_text() == (first.out_dir / name).read_text()
