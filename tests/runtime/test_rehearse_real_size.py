"""`partita rehearse` of real-size searched plans (issue 15; split out of ``test_rehearse.py`` so that the
test run's workers share it out).

The slow real-size tests compile searched plans (gpt3-6.7b on mixed-lab, gpt3-13b on A100s + V100s,
rows of ``bench/rehearse.py``) and rehearse every stage: collectives equal the plan's records, FLOPs
within 5%, and peak memory within 10% (``search/layer/saved.py``: saved activations in the dtype the
precision mode keeps; ``stage_cost.static_memory``: f32 parameters, gradients and moments, FSDP2's
gathered copies; a zero-bubble ZeRO-1 stage's deferred-W bf16 gradient copy beside the f32 ones; a
ZeRO-2/3 unit's gradients in flight to the reduce-scatter). The zb_h1 ZeRO-1 bf16 case, which the
gpt3-6.7b search picked before its W copy was priced (+13% then), is a fast hand layout in
``test_rehearse_schedules.py``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from partita.backends.torch import rehearse

_DONE: dict[str, dict] = {}


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("rehearse")


# ---- real-size searched plans (issue 15: `bench/rehearse.py` prints the full table) ---------------------
REAL_SIZE = ["gpt3-6.7b-search", "gpt3-13b-search", "llama-7b-search"]  # issue 15: three rows in the suite


def _real_size(work: Path, name: str) -> dict:
    """A row of ``bench/rehearse.py`` compiled by the search and rehearsed once per session."""
    import sys

    if name not in _DONE:
        sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
        from rehearse import ROWS  # bench/rehearse.py

        from partita.driver import compile_to_dir
        from partita.search.pricing.config import TrainingConfig

        model, cluster, batch, seq, _ = ROWS[name]
        out = work / name
        compile_to_dir(model, cluster, TrainingConfig(global_batch=batch, seq_len=seq), out)
        _DONE[name] = rehearse.rehearse_dir(out)
    return _DONE[name]


@pytest.mark.slow
@pytest.mark.parametrize("name", REAL_SIZE)
def test_real_size_searched_plan_issues_its_records(work: Path, name: str) -> None:
    """Every stage of a searched real-size plan issues exactly the plan's collective records (kind, axis,
    count; bytes within 2%) and the FLOPs it records (within 5%)."""
    res = _real_size(work, name)
    for s in res["stages"]:
        assert set(s["collectives"]) == set(s["planned_collectives"]), (s["index"], s["mismatches"])
        for key, got in s["collectives"].items():
            want = s["planned_collectives"][key]
            assert got["count"] == want["count"], (s["index"], key)
            assert got["bytes"] == pytest.approx(want["bytes"], rel=rehearse.BYTES_TOL), (s["index"], key)
        assert s["flops"] == pytest.approx(s["planned_flops"], rel=rehearse.FLOPS_TOL), s["index"]


@pytest.mark.slow
@pytest.mark.parametrize(
    "name",
    [
        "gpt3-13b-search",
        "gpt3-6.7b-search",  # a 2-stage ZB-H1 ZeRO-1 f16 plan (its first stage holds no deferred-W copy)
        "llama-7b-search",  # ZB-V, one micro-batch, bf16 ZeRO-1: gradients stay bf16 copies (search/program/v_layout.py)
    ],
)
def test_real_size_searched_plan_peak_memory(work: Path, name: str) -> None:
    """Peak memory per stage within 10% of the plan's record (the rehearsals of the test above, reused)."""
    res = _real_size(work, name)
    for s in res["stages"]:
        assert s["peak_memory_bytes"] == pytest.approx(s["planned_memory_bytes"], rel=rehearse.MEMORY_TOL), s["index"]
