"""``partita evaluate`` and ``partita compile --tp ...`` of one layout print one step time (issue 32 item 5).

Both price the tensor parallelism the emitted program runs (``search/entry/evaluate.tp_style_of``); before,
``evaluate`` priced Megatron-LM's and ``compile`` the torch program's, and the same layout came out
2-20% apart. The check goes through the two driver entries the CLI calls, not through the shared function.
Sequence parallelism too: ``evaluate --sequence-parallel`` (refused before) prints compile's step time and
compile's memory per device, stage by stage (``search/program/sequence_parallel.activation_delta``).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from partita.driver import compile_layout, evaluate_model
from partita.search.pricing.config import TrainingConfig


def test_evaluate_and_compile_print_one_number(tmp_path: Path) -> None:
    layout = dict(tp=2, pp=1, dp=2, micro_batch=2)  # tp styles differ here: the old evaluate was 2% off
    tr = TrainingConfig(global_batch=8, seq_len=32)
    ev = evaluate_model("gpt2-tiny", "4xA100-80G", tr, **layout)
    full = layout | {"zero_stage": 0, "recompute": "none", "schedule": "1f1b", "num_virtual": 1}
    got = compile_layout("gpt2-tiny", "4xA100-80G", tr, tmp_path / "out", layout=full)
    assert got.plan.predicted["step_time_s"] == pytest.approx(
        ev.predicted_step_time_s, rel=1e-8
    )  # plan.json keeps 10 significant digits


def test_evaluate_prices_sequence_parallelism_as_compile_writes_it(tmp_path: Path) -> None:
    from partita.models import families

    spec = str(families.write_config(tmp_path / "llama", families.tiny("llama")))
    layout = dict(tp=2, pp=2, dp=1, micro_batch=2, recompute="none")
    tr = TrainingConfig(global_batch=8, seq_len=16, dtype="bf16")
    plain = evaluate_model(spec, "4xCPU", tr, **layout)
    ev = evaluate_model(spec, "4xCPU", tr, **layout, sequence_parallel=True)
    full = layout | {"zero_stage": 0, "schedule": "1f1b", "num_virtual": 1, "sequence_parallel": True}
    got = compile_layout(spec, "4xCPU", tr, tmp_path / "out", layout=full)
    assert got.plan.predicted["step_time_s"] == pytest.approx(ev.predicted_step_time_s, rel=1e-8)
    assert ev.predicted_step_time_s == plain.predicted_step_time_s  # RS + AG = AR on a ring
    assert ev.layout["sequence_parallel"] and not plain.layout["sequence_parallel"]
    for i, st in enumerate(got.plan.stages):
        assert "sequence_parallel" in st.tp_plan.values()
        assert st.predicted["memory_bytes"] == pytest.approx(ev.memory_per_device[i], rel=1e-8)
        acts = st.predicted["memory_by_category"]["activations"]
        assert acts == pytest.approx(ev.memory_by_category[i]["activations"], rel=1e-8)
        assert ev.memory_by_category[i]["activations"] < plain.memory_by_category[i]["activations"]
