"""A ZB-H1 head stage's deferred micro-batches hold the logits' gradient, not the loss's log-probabilities
(issue 33).

``backends/torch/wsplit.py`` keeps a micro-batch's graph from B to W only below its split nodes (the
parameter ops): the loss's nodes after the head's matmul, and the f32 log-probabilities they save, die
with the stage's output at B. The plan weighed each deferred micro-batch of the head as its whole saved
activations plus the logits' gradient, so the qwen2-7b config.json row's head stage (last ZB-H1
position) rehearsed 27.8% under its plan. Shown on a tiny Qwen2 whose vocabulary dwarfs the rest, at
ZB-H1 pp2 x dp2 ZeRO-1 in bf16 (its head stage rehearsed 22.6% under the old price), rehearsed.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from partita.backends.torch import rehearse
from partita.cli import main as cli_main
from partita.models.families import config, write_config
from partita.plan import Plan


@pytest.mark.slow
def test_zb_h1_head_stage_deferred_micro_batches_drop_the_loss_saved_tensors(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PARTITA_CACHE_DIR", str(tmp_path / "cache"))
    vocab, seq = 16384, 64
    cfg = {**config("qwen2", h=32, l=2, a=4, k=2, f=64, v=vocab, p=256), "bos_token_id": 0, "eos_token_id": 0}
    model = write_config(tmp_path / "model", {**cfg, "pad_token_id": 0})
    out = tmp_path / "plan"
    args = ["compile", str(model), "--cluster", "4xCPU", "--seq", str(seq), "--tp", "1", "--pp", "2", "--dp", "2"]
    args += ["--micro-batch", "1", "--global-batch", "16", "--zero", "1", "--precision", "bf16"]
    assert cli_main([*args, "--schedule", "zb_h1", "--out", str(out)]) == 0
    plan = Plan.from_json((out / "plan.json").read_text())
    assert plan.schedule == "zb_h1" and "lm_head.weight" in plan.stages[1].param_placements
    log_probs = (seq - 1) * vocab * 4  # f32 log-probabilities of one micro-batch (the shifted targets)
    s = rehearse.rehearse_dir(out)["stages"][1]
    got, want = s["peak_memory_bytes"], s["planned_memory_bytes"]
    assert want == plan.stages[1].predicted["memory_bytes"]
    assert 3 * log_probs < got  # the loss is most of the stage
    # the old price kept every deferred micro-batch's log-probabilities: 1.5 of them over the program
    assert abs(got - want) < 0.5 * log_probs, (got, want, log_probs, s["memory_by_category"])
