"""What a ``torch.distributed.pipelining`` program holds for all its micro-batches at once (issue 33).

The gpt3-13b config.json row (tp8 x pp2 x dp2, sequence 2048, 32 micro-batches) rehearsed its last
stage 28% over its plan; two causes, each shown here on a two-stage GPT-2 of a few hundred thousand
parameters whose one cause outweighs the rest of the stage, rehearsed at its full world size:

* **the last stage's outputs**: ``Schedule.step`` keeps every micro-batch's output (the logits) to the
  end of the step and concatenates them, unless ``return_outputs=False``; the program never reads
  them (``backends/torch/schedule.TorchPipeline``, which now asks for none). A large vocabulary: the
  old runner held ``2 m`` logits and rehearsed the last stage far over its plan;
* **the receive buffers**: ``PipelineStage`` allocates one buffer per micro-batch for the activation it
  receives and for the gradient it receives, for the whole run
  (``search/program/receive_buffers.py``, now priced). A wide boundary and many micro-batches: the old
  plan left ``m`` boundaries per direction out.

On the stages that hold the cause, the plan and the rehearsal now differ by far less than the cause
(the old runner / plan: by at least all of it).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from partita.backends.torch import rehearse
from partita.cli import main as cli_main
from partita.plan import Plan
from partita.search.program import records


def _compile(tmp: Path, embd: int, vocab: int, seq: int, batch: int) -> Path:
    cfg = tmp / "config.json"
    cfg.write_text(json.dumps({"model_type": "gpt2", "n_embd": embd, "n_layer": 2, "n_head": 4, "vocab_size": vocab}))
    out = tmp / "plan"
    args = ["compile", str(cfg), "--cluster", "2xCPU", "--seq", str(seq), "--tp", "1", "--pp", "2", "--dp", "1"]
    args += ["--micro-batch", "1", "--global-batch", str(batch), "--schedule", "1f1b", "--zero", "0"]
    assert cli_main([*args, "--precision", "bf16", "--out", str(out)]) == 0
    return out


@pytest.mark.slow
@pytest.mark.parametrize(
    "cause, embd, vocab, seq, batch",
    [
        ("outputs", 32, 8192, 64, 16),  # logits (64 x 8192) dwarf a block of 32 wide
        ("receive buffers", 256, 256, 128, 64),  # 64 micro-batches of a 128 x 256 boundary per direction
    ],
)
def test_pipelining_stage_memory_is_priced_as_held(
    cause: str, embd: int, vocab: int, seq: int, batch: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PARTITA_CACHE_DIR", str(tmp_path / "cache"))
    out = _compile(tmp_path, embd, vocab, seq, batch)
    plan = Plan.from_json((out / "plan.json").read_text())
    assert records.runner_kind(plan) == "torch_pipeline" and plan.num_micro_batches == batch
    m = plan.num_micro_batches
    # the bytes of the cause on the stages that hold it: the logits kept by the old runner (bf16, m of them,
    # and their concatenation as much again) on the last stage; the buffers (bf16, m per direction) on both
    size = {"outputs": {1: m * seq * vocab * 2}, "receive buffers": {0: m * seq * embd * 2, 1: m * seq * embd * 2}}[
        cause
    ]
    res = rehearse.rehearse_dir(out)
    for i, nbytes in size.items():
        s = res["stages"][i]
        got, want = s["peak_memory_bytes"], s["planned_memory_bytes"]
        # the plan prices the cause as the program holds it: what is left between the two is small beside it
        # (the old runner / plan: at least the whole cause apart)
        assert abs(got - want) < 0.5 * nbytes, (cause, i, got, want, nbytes, s["memory_by_category"])
    if cause == "receive buffers":  # large beside the rest of the stage, in the plan's activations
        for i, st in enumerate(plan.stages):
            assert size[i] > 0.1 * st.predicted["memory_bytes"]
            assert st.predicted["memory_by_category"]["activations"] > size[i]
