"""The shipped calibration profiles describe devices, not programs (issue 32).

The A100 profile was fitted on Megatron-DeepSpeed runs, which all-reduce the gradients once after the
backward; fitted as the device's ``comm_overlap`` = 0 it priced every FSDP (ZeRO-2/3) reduce-scatter on an
A100 exposed after the backward, although FSDP (llm-foundry's, Partita's FSDP2) reduce-scatters each unit's
gradients inside it: MosaicML's A100-40G rows came out 3-12% too slow, the 70B one mostly in that tail.
Now the benches price Megatron's after-backward sync as the program's (``bench/published.py``:
``SolverCosts.flat_sync``; ``bench/costmodel_accuracy.py``: the fitted value recorded under the profile's
``program``, which prices only its rows), and no shipped profile's ``efficiency`` carries a ``comm_overlap``
of its own. H100-80G and H200 ship the H100 profile (``bench/h100_calibration.py``), fitted on published
H100 rows.
"""

from __future__ import annotations

import dataclasses
import json

import pytest

from partita.cluster import SHIPPED_PROFILES, parse_cluster, profile_path
from partita.search.entry.evaluate import evaluate_config
from partita.search.pipeline.stage_cost import SolverCosts
from partita.search.pricing.config import TrainingConfig
from partita.search.pricing.cost_model import CostModel, Efficiency
from tests.search.builders import gpt_with_ends

TR = TrainingConfig(global_batch=16, seq_len=1024)


@pytest.mark.parametrize("device", ["A100-40G", "A100-80G", "H100-80G", "H200"])
def test_shipped_profiles_leave_the_gradient_sync_overlap_to_the_program(device: str) -> None:
    dev = parse_cluster(f"8x{device}").groups[0].device
    assert dev.profile == SHIPPED_PROFILES[device]
    assert CostModel.for_device(dev).efficiency.comm_overlap == Efficiency().comm_overlap
    program = json.loads(profile_path(dev.profile).read_text()).get("program", {}).get("factors", {})
    assert set(program) <= {"comm_overlap"}  # what a program fitted with the device factors keeps apart


def test_fsdp_reduce_scatter_hides_under_the_backward_on_a_calibrated_a100() -> None:
    """ZeRO-3 over two A100-40G nodes: the shipped factors hide the units' reduce-scatters under the backward
    (the tail keeps the last unit's); the same factors with nothing hidden (the old profile) price it all
    after the backward."""
    g = gpt_with_ends(12, 1024, 16)
    cl = parse_cluster("16xA100-40G")
    dev = cl.groups[0].device
    eff = CostModel.for_device(dev).efficiency
    kw = {"tp": 1, "pp": 1, "dp": 16, "micro_batch": 1, "zero_stage": 3}
    shipped = evaluate_config(g, cl, TR, **kw)
    costs = SolverCosts(g, cl, TR, tp_style="torch")
    costs._cm[dev.name] = CostModel(dev, dataclasses.replace(eff, comm_overlap=0.0))
    exposed = evaluate_config(g, cl, TR, costs=costs, **kw)
    assert shipped.tail_s < exposed.tail_s / 4
    assert shipped.predicted_step_time_s < exposed.predicted_step_time_s


def test_h100_profile_is_shipped_for_h100_and_h200_and_names_what_it_was_fitted_on() -> None:
    for device in ("H100-80G", "H200"):
        on, off = parse_cluster(f"8x{device}"), parse_cluster(f"8x{device}", calibrated=False)
        assert on.groups[0].device.profile == "partita:h100_calibration.json"
        assert off.groups[0].device.profile == "" and on.fingerprint() != off.fingerprint()
        assert CostModel.for_device(on.groups[0].device).efficiency != Efficiency()
    d = json.loads(profile_path(SHIPPED_PROFILES["H100-80G"]).read_text())
    assert d["device"] == "H100-80G" and d["applies_to"] == ["H200"]
    assert "published_runs.csv" in d["fitted_on"]
    readme = (profile_path(SHIPPED_PROFILES["H100-80G"]).parent / "README.md").read_text()
    assert "h100_calibration.json" in readme
