"""Cost-model accuracy on the measured Megatron runs (A100-80G), the way a user gets it.

``bench/costmodel_accuracy.py`` fits the shipped profile on all 109 rows and measures held-out
accuracy by leave-one-model-size-out (LOMSO) and leave-one-row-out. These tests re-price rows
through the same path as ``partita evaluate`` (shorthand cluster, shipped calibration applied by
default) and check the targets of issue 18:

* shipped defaults, every third row: median abs error <= 8%, Spearman >= 0.9 (in-sample: the
  profile was fitted on these rows; the held-out numbers are the next test);
* LOMSO: the factors the benchmark fitted *without* a size (recorded in its results) predict that
  size's rows within 10% median, re-priced here by the current code, so a cost-model change that
  breaks generalization fails.

The 39.1B rows contradict themselves (``test_39b_rows_invert_matched_pairs``), which caps any
model's rank correlation on that size.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from partita.cluster import parse_cluster
from partita.search.pricing.cost_model import CostModel, Efficiency

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
RESULTS = ROOT / "bench" / "results" / "costmodel_accuracy.json"


def test_cli_cluster_applies_the_shipped_profile() -> None:
    import costmodel_accuracy as ca

    dev = parse_cluster("64xA100-80G").groups[0].device
    eff = CostModel.for_device(dev).efficiency
    shipped = json.loads(ca.PROFILE.read_text())
    assert eff == Efficiency.from_profile(shipped, "A100-80G") and eff != Efficiency(device="A100-80G")
    assert "all 109 rows" in shipped["fitted_on"]
    recorded = json.loads(RESULTS.read_text())["shipped"]["profile"]
    assert {k: getattr(eff, k) for k in recorded} == recorded  # the profile the benchmark measured
    # with the program factors fitted to Megatron-DeepSpeed's rows, kept apart from the device's (issue 32)
    assert json.loads(RESULTS.read_text())["shipped"]["program"] == shipped["program"]["factors"]


@pytest.mark.slow
def test_shipped_defaults_meet_targets_on_every_third_row() -> None:
    import costmodel_accuracy as ca

    rows = ca.load_rows()[::3]
    pred = [ca.evaluate_row(r).predicted_step_time_s for r in rows]  # parse_cluster + evaluate_config
    m = ca.metrics(rows, pred)
    assert m["median_abs_err"] <= 0.08 and m["spearman"] >= 0.9, m


@pytest.mark.slow
@pytest.mark.parametrize("size", ["18.4B", "175.0B"])
def test_factors_fitted_without_a_size_predict_it(size: str) -> None:
    import costmodel_accuracy as ca

    fitted = json.loads(RESULTS.read_text())["lomso"]["fitted"][size]
    eff = ca.efficiency(fitted)
    held = [r for r in ca.load_rows() if f"{r['params_b']}B" == size]
    m = ca.metrics(held, ca.predict(held, eff))
    assert m["median_abs_err"] <= 0.10, (size, m)
    uncal = ca.metrics(held, ca.predict(held, Efficiency(device="A100-80G")))
    assert m["median_abs_err"] < uncal["median_abs_err"], (m, uncal)  # the fit transfers, not just the preset


def test_39b_rows_invert_matched_pairs() -> None:
    """Only the 39.1B rows contradict themselves: in 11 of 29 matched pairs (same pp, micro-batch
    count and per-GPU work, only tp differs) the larger-tp run measures over 10% *faster*."""
    import costmodel_accuracy as ca

    cons = ca.consistency(ca.load_rows())
    assert cons["39.1B"]["inversions"] >= 10 and cons["39.1B"]["worst"]["ratio"] < 0.7, cons["39.1B"]
    for size in ("3.6B", "18.4B", "175.0B"):
        assert cons[size]["pairs"] >= 3 and cons[size]["inversions"] == 0, (size, cons[size])
