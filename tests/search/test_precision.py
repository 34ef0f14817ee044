"""Precision per plan (fp16 when GPUs without bf16 tensor cores are in the cluster) and the MFU sanity record."""

from __future__ import annotations

import dataclasses

import pytest

from partita.cluster import parse_cluster
from partita.search.pricing.config import SearchOptions, TrainingConfig
from partita.search.pricing.precision import choose_precision, idle_reasons, precision_note

TR = TrainingConfig(global_batch=16, seq_len=512)


@pytest.mark.parametrize(
    "spec, dtype",
    [("mixed-lab", "f16"), ("16xA100-80G+16xV100-32G", "f16"), ("8xT4", "f16"), ("16xA100-80G", "bf16")]
    + [("8xH100-80G+8xL4", "bf16"), ("4xCPU", "bf16")],
)
def test_bf16_becomes_f16_only_where_a_gpu_lacks_bf16_tensor_cores(spec: str, dtype: str) -> None:
    assert choose_precision(parse_cluster(spec), TR).dtype == dtype


def test_explicit_choices_are_kept() -> None:
    cl = parse_cluster("mixed-lab")
    assert choose_precision(cl, TR, allow_f16=False).dtype == "bf16"
    assert choose_precision(cl, dataclasses.replace(TR, dtype="f32")).dtype == "f32"


def test_notes_give_the_numbers() -> None:
    cl = parse_cluster("16xA100-80G+16xV100-32G")
    assert "V100-32G (15.7 -> 125 TFLOP/s)" in precision_note(cl, "f16")
    assert "no bf16 tensor cores" in precision_note(cl, "bf16")
    why = idle_reasons(cl, {"A100-80G": 16}, "bf16")
    assert set(why) == {"V100-32G"} and "16 of 16 idle" in why["V100-32G"] and "fp16 would give 125" in why["V100-32G"]
    assert idle_reasons(cl, {"A100-80G": 16, "V100-32G": 16}, "f16") == {}


def test_planner_records_precision_and_mfu_sanity() -> None:
    from partita.passes.annotate import annotate
    from partita.search.entry.planner import plan_graph
    from tests.search.builders import gpt

    g0 = gpt(4, 1024, 16)
    g = annotate(g0)
    g.layers = g0.layers
    cl = parse_cluster("8xA100-80G+8xV100-32G")
    plan = plan_graph(g, cl, TR, options=SearchOptions(max_micro_batch=4, num_alternatives=1))
    p = plan.predicted
    assert plan.training["dtype"] == "f16" and p["precision"]["dtype"] == "f16"
    assert p["devices_total"] == 16 and 1 <= p["devices_used"] <= 16
    assert p["mfu_cluster"] <= p["mfu"] + 1e-12 and p["mostly_idle"] == (2 * p["devices_used"] < 16)
    assert "4 x 100 Gb/s" in p["network"] and "8 x 200 Gb/s" in p["network"]
    assert (p["idle_reasons"] == {}) == (p["devices_used"] == 16)
