"""Cost-model accuracy targets on the held-out half of the measured Megatron runs (A100-80G)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from partita.search.cost_model import Efficiency
from partita.search.stage_cost import StageFactors

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))


@pytest.mark.slow
def test_test_split_meets_targets() -> None:
    import costmodel_accuracy as ca

    prof = json.loads(ca.PROFILE.read_text())
    eff = Efficiency.from_profile(prof, "A100-80G")
    fac = StageFactors(**prof.get("stage", {}))
    test = [r for r in ca.load_rows() if r["split"] == "test"]
    assert 40 <= len(test) <= 70
    m = ca.metrics(test, ca.predict(test, eff, fac))
    assert m["median_abs_err"] <= 0.10, m
    assert m["spearman"] >= 0.85, m
