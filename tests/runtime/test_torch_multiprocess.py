"""Generated programs under torchrun (gloo): losses and gradients equal the seeded single-device run.

One launch per (model, layout) checks, together: losses of 3 steps, full gradients after optimizer
steps 1 and 3 (rtol 1e-4, atol 1e-5), and, per stage and kind, the collectives counted in the last
step: equal to the program's prediction and to the counts derived from the layout
(``plans.expected``). The DCP test saves at step 2, resumes, and compares step 3.
"""

from __future__ import annotations

import glob
import os
from pathlib import Path

import pytest
import torch

from partita.backends.torch import launch as torch_launch
from partita.backends.torch.emit import emit_torch
from partita.backends.torch.train import reference_run
from tests.runtime.plans import expected, layout

pytestmark = pytest.mark.multiprocess
os.environ.setdefault("OMP_NUM_THREADS", "1")
MATRIX = [
    ("gpt2-tiny", n)
    for n in ("dp", "tp", "tp_gather", "dp_tp", "zero1", "zero3", "uneven", "pp_1f1b", "pp_gpipe", "pp_tp", "hetero")
]
MATRIX += [("llama-tiny", "tp_full"), ("llama-tiny", "tp_selective"), ("llama-tiny", "hetero")]
MATRIX += [("mlp", "dp_tp"), ("mlp", "zero3"), ("mlp", "pp_1f1b")]
_REF: dict = {}


def _reference(model: str, plan) -> dict:
    key = (model, plan.training["global_batch"])
    if key not in _REF:
        _REF[key] = reference_run(model, plan.training, 3, dump_steps=(1, 3))
    return _REF[key]


def _run(tmp: Path, model: str, name: str, *extra: str, steps: int = 3) -> tuple[dict, object]:
    plan = layout(model, name)
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "plan.json").write_text(plan.to_json())
    (tmp / "program_torch.py").write_text(emit_torch(plan, model))
    return torch_launch.run(tmp, steps=steps, extra_args=extra), plan


@pytest.mark.parametrize("model, name", MATRIX)
def test_matches_single_device(tmp_path: Path, model: str, name: str) -> None:
    res, plan = _run(tmp_path, model, name, "--dump-grads", str(tmp_path / "g"), "--dump-steps", "1,3")
    ref = _reference(model, plan)
    torch.testing.assert_close(torch.tensor(res["losses"]), torch.tensor(ref["losses"]), rtol=1e-4, atol=1e-5)
    for step in (1, 3):
        got: dict[str, torch.Tensor] = {}
        for f in glob.glob(str(tmp_path / "g" / f"grads_step{step}_rank*.pt")):
            got.update(torch.load(f))
        assert set(got) == set(ref["grads"][step])
        for n, g in ref["grads"][step].items():
            torch.testing.assert_close(got[n], g, rtol=1e-4, atol=1e-5, msg=lambda m, n=n: f"{n}: {m}")
    want = expected(model, plan)
    for idx in want:
        key = f"stage{idx}"
        measured = {k: v["count"] for k, v in res["collectives"][key].items()}
        predicted = {k: v["count"] for k, v in res["predicted_collectives"][key].items()}
        assert measured == want[idx], (key, measured, want[idx])
        assert predicted == want[idx], (key, predicted, want[idx])
        assert res["collective_mismatches"].get(key, []) == [], res["collective_mismatches"]
    assert len(res["step_time_s"]) == 3 and res["predicted_step_time_s"] == 0.05


def test_dcp_resume(tmp_path: Path) -> None:
    full, _ = _run(tmp_path / "a", "gpt2-tiny", "pp_tp", "--checkpoint-every", "2")
    ck = tmp_path / "a" / "checkpoints"
    assert sorted(p.name for p in ck.iterdir()) == ["step-000002"]
    res, _ = _run(tmp_path / "a", "gpt2-tiny", "pp_tp", "--resume")
    assert res["start_step"] == 2 and len(res["losses"]) == 1
    torch.testing.assert_close(res["losses"][0], full["losses"][2], rtol=1e-6, atol=1e-7)
