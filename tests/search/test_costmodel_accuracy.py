"""Cost-model accuracy targets on the held-out half of the measured Megatron runs (A100-80G).

The profile is fitted on the train half by ``bench/costmodel_accuracy.py``; this test prices the
test half with it. Targets (issue #4): median abs error <= 10% and Spearman >= 0.85, overall and
per model size. Known miss, asserted at its current level so a regression still fails: the 39.1B
rows' Spearman (0.55). ``test_39b_rows_invert_matched_pairs`` pins down why: in 11 of its 29
matched pairs (same pp, micro-batch count and per-GPU work, only tp differs) the larger-tp run
measures over 10% *faster*, up to 1.52x, which no compute + communication model can rank; the
other three sizes have 0 inversions in 42 such pairs.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from partita.search.cost_model import Efficiency
from partita.search.stage_cost import StageFactors

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

SPEARMAN_FLOOR = {39.1: 0.5}  # the documented miss above; every other size meets 0.85


@pytest.mark.slow
def test_test_split_meets_targets() -> None:
    import costmodel_accuracy as ca

    prof = json.loads(ca.PROFILE.read_text())
    eff = Efficiency.from_profile(prof, "A100-80G")
    fac = StageFactors(**prof.get("stage", {}))
    test = [r for r in ca.load_rows() if r["split"] == "test"]
    assert 40 <= len(test) <= 70
    pred = ca.predict(test, eff, fac)
    m = ca.metrics(test, pred)
    assert m["median_abs_err"] <= 0.10, m
    assert m["spearman"] >= 0.85, m
    for size in sorted({r["params_b"] for r in test}):
        idx = [i for i, r in enumerate(test) if r["params_b"] == size]
        per = ca.metrics([test[i] for i in idx], [pred[i] for i in idx])
        assert per["median_abs_err"] <= 0.10, (size, per)
        assert per["spearman"] >= SPEARMAN_FLOOR.get(size, 0.85), (size, per)


def test_39b_rows_invert_matched_pairs() -> None:
    """The data behind SPEARMAN_FLOOR: only the 39.1B rows contradict themselves.

    If this fails, the measured file changed: re-run ``bench/costmodel_accuracy.py`` and revisit
    the floor.
    """
    import costmodel_accuracy as ca

    cons = ca.consistency(ca.load_rows())
    assert cons["39.1B"]["inversions"] >= 10 and cons["39.1B"]["worst"]["ratio"] < 0.7, cons["39.1B"]
    for size in ("3.6B", "18.4B", "175.0B"):
        assert cons[size]["pairs"] >= 3 and cons[size]["inversions"] == 0, (size, cons[size])
