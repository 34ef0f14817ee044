"""`partita compile --json` reports trace / search wall times and peak RSS; plan files stay byte-identical."""

from __future__ import annotations

from pathlib import Path

import pytest

from partita.driver import compile_to_dir
from partita.search.pricing.config import TrainingConfig


def test_json_has_timings_and_plans_stay_identical(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    train = TrainingConfig(global_batch=16, seq_len=32)
    outs = []
    for k in range(2):  # two cold compiles (separate caches): timings differ, plan bytes may not
        monkeypatch.setenv("PARTITA_CACHE_DIR", str(tmp_path / f"cache{k}"))
        got = compile_to_dir("gpt2-tiny", "4xA100-80G", train, tmp_path / f"out{k}")
        s = got.summary()
        assert not s["cache_hit"]
        assert s["search_time_s"] is not None and s["search_time_s"] > 0
        assert s["trace_time_s"] is not None and s["trace_time_s"] > 0
        assert s["peak_rss_bytes"] > 50 * 2**20  # torch alone is larger than this
        assert s["compile_time_s"] >= s["search_time_s"]
        outs.append((tmp_path / f"out{k}" / "plan.json").read_bytes())
    assert outs[0] == outs[1]
    assert b"search_time_s" not in outs[0] and b"trace_time_s" not in outs[0]
    hit = compile_to_dir("gpt2-tiny", "4xA100-80G", train, tmp_path / "out2")
    assert hit.cache_hit and hit.summary()["search_time_s"] is None  # a hit searched nothing
