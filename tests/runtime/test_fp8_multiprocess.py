"""FP8 training (issue 36 part 2) runs as the plan says on 4 gloo ranks: a tiny Llama compiled with
``--precision fp8`` as a hand layout (dp 2 x pp 2, ZeRO-1 on dp), its program converting each stage with
torchao's ``convert_to_float8_training`` (``backends/torch/fp8.py``; on CPU torch's ``_scaled_mm`` CPU kernel).

Tolerance (docs/parity.md, "FP8"): the losses of 3 steps within ``rtol = 2**-7`` of the seeded single-device
bf16 run (``partita run --reference``: the same model and data under bf16 autocast, no FP8). E4M3's unit
roundoff is ``2**-4`` per element; the loss averages it over every logit and token, so a correct conversion
lands far inside ``2**-7`` (measured: 1.4e-4 relative) while a wrong scale (amax) moves it by whole units.
Every parameter's step-1 gradient and step-3 value is within fp8's tolerance of the bf16 run
(``parity.TOLERANCE["fp8"]``: 4 E4M3 units), and the collectives counted equal the plan's records. That the program's set-up swaps the linears for
``Float8Linear`` is checked in one process by ``test_fp8_emit.py``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

pytest.importorskip("torchao", reason="torchao is the optional [fp8] extra")
pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]
os.environ.setdefault("OMP_NUM_THREADS", "1")
FP8_LOSS_RTOL = 2.0**-7


def test_fp8_hand_layout_trains_close_to_bf16_on_4_ranks(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from partita.cli import main
    from partita.models import families

    spec = str(families.write_config(tmp_path / "llama", families.tiny("llama")) / "config.json")
    out = tmp_path / "plan"
    layout = ["--tp", "1", "--pp", "2", "--dp", "2", "--micro-batch", "2", "--zero", "1"]
    args = ["compile", spec, "--cluster", "4xCPU", "--global-batch", "8", "--seq", "16", *layout]
    assert main([*args, "--precision", "fp8", "--fp8-recipe", "tensorwise", "--out", str(out), "--json"]) == 0
    capsys.readouterr()
    plan = json.loads((out / "plan.json").read_text())
    assert plan["training"]["fp8"] == "tensorwise" and plan["training"]["dtype"] == "bf16"
    assert "fp8 (tensorwise)" in plan["predicted"]["precision"]["why"]
    src = (out / "program_torch.py").read_text()
    line = "module, config=Float8LinearConfig.from_recipe_name('tensorwise'), module_filter_fn=fp8.runs_in_fp8"
    assert src.count(line) == 2  # the plan's recipe, literally, in both stages
    assert main(["run", str(out), "--steps", "3", "--reference", "--json"]) == 0
    capsys.readouterr()
    res = json.loads((out / "run_log.json").read_text())
    got, ref = res["losses"], res["reference_losses"]
    assert len(got) == 3
    for g, r in zip(got, ref):
        assert g == pytest.approx(r, rel=FP8_LOSS_RTOL)
    result = res["result"]
    assert all(not m for m in result["collective_mismatches"].values()), result["collective_mismatches"]
    parity = result["parity"]  # per parameter, against the bf16 run at fp8's tolerance (parity.TOLERANCE)
    assert parity["ok"] and parity["dtype"] == "fp8" and parity["num_compared"] > 0, parity["failing"]
