"""`partita rehearse` on pipelines whose stages differ by their position only (issue 15).

What these tests prove, each on a small hand layout rehearsed at its full world size:

* ZB-H1 (``search/pipeline/zero_bubble.py``): the stage at pipeline position ``i`` runs rank ``i``'s action
  list, which holds ``p - i`` forwards and defers ``i`` W's; the plan prices each position at that
  list's own count (``schedule.peak_in_flight(...)[i]``), not every stage at the most loaded rank's.
  Every stage's rehearsed peak is within 10% of its plan, and between two stages of the same layers
  the plan's memory grows with the position by what the program's does (the old pricing recorded
  them equal);
* ZeRO-3 with a middle stage (no embedding or head: no FSDP root unit with parameters): the first
  backward all-gathers the last block once more (FSDP2's backward prefetch follows the post-forward
  order of the warm-up forwards, ``search/records._prefetches_again``), and the plan records it:
  every stage's collectives match (the old records were one all-gather short there, as on the
  gpt3-175b plan's middle stages: 481 against 480).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from partita.backends.torch import rehearse
from partita.cli import main as cli_main
from partita.plan import Plan


def _compile(tmp: Path, n_layer: int, seq: int, ranks: int, layout: list[str]) -> Path:
    cfg = tmp / "config.json"
    cfg.write_text(json.dumps({"model_type": "gpt2", "n_embd": 64, "n_layer": n_layer, "n_head": 4, "vocab_size": 256}))
    out = tmp / "plan"
    args = ["compile", str(cfg), "--cluster", f"{ranks}xCPU", "--seq", str(seq), "--tp", "1", "--micro-batch", "1"]
    assert cli_main([*args, *layout, "--precision", "bf16", "--out", str(out)]) == 0
    return out


def test_zb_h1_prices_each_position_at_its_own_count(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PARTITA_CACHE_DIR", str(tmp_path / "cache"))
    layout = ["--global-batch", "16", "--pp", "4", "--dp", "1", "--schedule", "zb_h1", "--zero", "0"]
    out = _compile(tmp_path, 8, 128, 4, layout)
    plan = Plan.from_json((out / "plan.json").read_text())
    assert plan.schedule == "zb_h1" and plan.num_stages == 4 and plan.num_micro_batches == 16
    counts = [s.predicted["in_flight"] for s in plan.stages]
    # stages 1 and 2 hold two blocks each: only their positions differ (the counts are checked against the
    # action lists in tests/search/test_zero_bubble_search.py)
    assert [len(s.layers) for s in plan.stages[1:3]] == [2, 2] and counts[1] < counts[2]
    res = rehearse.rehearse_dir(out)
    got = [s["peak_memory_bytes"] for s in res["stages"]]
    want = [s.predicted["memory_bytes"] for s in plan.stages]
    for g, w, s in zip(got, want, res["stages"], strict=True):
        assert g == pytest.approx(w, rel=rehearse.MEMORY_TOL), s
    # position 2 holds more than position 1 (one more deferred W than a forward less): as priced
    assert got[2] - got[1] == pytest.approx(want[2] - want[1], rel=0.35)
    assert want[2] - want[1] > 0.02 * want[1]
    assert res["match"], [s["mismatches"] for s in res["stages"]]


def test_zero3_middle_stage_records_the_first_backward_prefetch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PARTITA_CACHE_DIR", str(tmp_path / "cache"))
    layout = ["--global-batch", "8", "--pp", "3", "--dp", "2", "--schedule", "1f1b", "--zero", "3"]
    out = _compile(tmp_path, 6, 32, 6, layout)
    plan = Plan.from_json((out / "plan.json").read_text())
    m = plan.num_micro_batches
    blocks = [sum(1 for n in s.layers if n not in ("embed", "head")) for s in plan.stages]
    res = rehearse.rehearse_dir(out)
    for s in res["stages"]:
        assert not [x for x in s["mismatches"] if "@" in x], (s["index"], s["mismatches"])
        assert s["collectives"]["all_gather@dp"] == s["planned_collectives"]["all_gather@dp"], s["index"]
    # the middle stage: 2m per block, and one more (stage 0 and 2 have a root unit and the tied weight)
    assert res["stages"][1]["collectives"]["all_gather@dp"]["count"] == 2 * m * blocks[1] + 1


def test_zb_h1_expert_parallel_stages_price_their_w_in_the_program_dtype_and_layout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Mixtral-shaped model, tp 2 (expert parallel, ``backends/torch/moe.py``) x pp 2, ZB-H1 in bf16.
    The first stage's W is its whole backward, in which autograd sums each local expert's zero-filled
    whole-stack gradient (``intra_op._LayerProblem.grad_transient``): the old plan left that out (first
    stage +14.6% rehearsed over it). The last stage's deferred W weighs its output gradients in the
    program's dtype and tp layout (``LayerCost.held_bytes``), not the traced graph's f32 unsharded ones.
    Each rank's tp peer is not rehearsed (``rehearse.roles``: it runs rank 0's step but its sends)."""
    monkeypatch.setenv("PARTITA_CACHE_DIR", str(tmp_path / "cache"))
    cfg = tmp_path / "config.json"
    cfg.write_text(
        json.dumps(
            {
                "model_type": "mixtral",
                "hidden_size": 128,
                "intermediate_size": 256,
                "num_hidden_layers": 2,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "num_local_experts": 4,
                "num_experts_per_tok": 2,
                "vocab_size": 256,
                "max_position_embeddings": 512,
            }  # fmt: skip
        )
    )
    out = tmp_path / "plan"
    args = ["compile", str(cfg), "--cluster", "4xCPU", "--seq", "256", "--global-batch", "16", "--tp", "2"]
    layout = ["--pp", "2", "--dp", "1", "--micro-batch", "1", "--schedule", "zb_h1", "--zero", "0"]
    assert cli_main([*args, *layout, "--precision", "bf16", "--out", str(out)]) == 0
    plan = Plan.from_json((out / "plan.json").read_text())
    assert plan.schedule == "zb_h1" and all(s.tp_plan.get(f"model.layers.{i}.mlp.experts") == "expert"
                                            for i, s in enumerate(plan.stages))  # fmt: skip
    res = rehearse.rehearse_dir(out)
    assert [s["ranks_rehearsed"] for s in res["stages"]] == [[0], [2]]
    assert res["match"], [s["mismatches"] for s in res["stages"]]


def test_roles_run_up_to_num_jobs_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """``PARTITA_REHEARSE_JOBS`` bounds the roles played at once (the tests above ran them through the
    pool); unset or not a positive integer: the CPUs this process may use; never more than the roles."""
    monkeypatch.setenv("PARTITA_REHEARSE_JOBS", "3")
    assert rehearse.num_jobs(34) == 3 and rehearse.num_jobs(2) == 2
    for bad in ("0", "-1", "many", ""):
        monkeypatch.setenv("PARTITA_REHEARSE_JOBS", bad)
        assert 1 <= rehearse.num_jobs(34) <= 34 and rehearse.num_jobs(1) == 1
