"""Re-planning: a checkpoint written under one plan resumes under another (other world size, other
cluster, other layout); DCP reshards the model and optimizer state on load.

Searched plans: mlp compiled for 4xCPU (dp=4) trains 5 steps with checkpoints at 2 and 4; the plan
compiled for 2xCPU (dp=2) resumes from step 4 and its step-5 loss matches the uninterrupted run's.
Hand layouts: gpt2-tiny trained under ``pp_tp`` (4 ranks, 2 pipeline stages x tp=2, parameters as
tp-sharded DTensors, each stage saving its own keys) resumes under ``zero3`` (2 ranks, FSDP2 shards).
The tolerance is rtol 1e-5 (fp32): another world size sums the gradients in another order, so the
next loss agrees to rounding, not bit for bit (the same-plan restarts in ``test_faults.py`` are exact).
A checkpoint of another training config is refused (catalogue case ``resume-other-run``).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from partita.backends.torch.emit import emit_torch
from tests.reliability.test_faults import cli
from tests.runtime.plans import layout

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]
RTOL = 1e-5


def compile_mlp(root: Path, cluster: str, global_batch: int = 64) -> Path:
    argv = ("compile", "mlp", "--cluster", cluster, "--global-batch", str(global_batch), "--seq", "32")
    out = root / f"{cluster}-{global_batch}"
    rc, _, err = cli(*argv, "--dtype", "f32", "--out", str(out), env={"PARTITA_CACHE_DIR": str(root / "cache")})
    assert rc == 0, err
    return out


def run(plan_dir: Path, steps: int, *extra: str) -> dict:
    rc, out, err = cli("run", str(plan_dir), "--steps", str(steps), "--json", *extra)
    assert rc == 0, err[-3000:]
    return json.loads(out)


@pytest.fixture(scope="module")
def four_rank(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    root = tmp_path_factory.mktemp("replan")
    plan4 = compile_mlp(root, "4xCPU")
    assert json.loads((plan4 / "plan.json").read_text())["stages"][0]["dp"] == 4
    return plan4, run(plan4, 5, "--checkpoint-every", "2")


def test_resume_under_other_world_size(four_rank: tuple[Path, dict], tmp_path: Path) -> None:
    plan4, full = four_rank
    plan2 = compile_mlp(tmp_path, "2xCPU")
    stages = json.loads((plan2 / "plan.json").read_text())["stages"]
    assert [(s["dp"], len(s["ranks"])) for s in stages] == [(2, 2)]
    res = run(plan2, 5, "--resume", "--", "--checkpoint-dir", str(plan4 / "checkpoints"))
    assert res["start_step"] == 4 and len(res["losses"]) == 1
    assert res["losses"][0] == pytest.approx(full["losses"][4], rel=RTOL, abs=0)
    assert res["losses_all"][:4] == full["losses"][:4]


def test_resume_refuses_other_training_config(four_rank: tuple[Path, dict], tmp_path: Path) -> None:
    plan4, _ = four_rank
    other = compile_mlp(tmp_path, "2xCPU", global_batch=32)
    ck = plan4 / "checkpoints"
    before = sorted(p.name for p in ck.iterdir())
    rc, _, err = cli("run", str(other), "--steps", "5", "--resume", "--", "--checkpoint-dir", str(ck))
    flat = " ".join(err.split())
    assert rc == 2 and "Traceback" not in err, err[-2000:]
    assert "was written by another run ({'global_batch': 64})" in flat, flat
    assert "this plan trains {'global_batch': 32}" in flat and "fresh --checkpoint-dir" in flat, flat
    assert sorted(p.name for p in ck.iterdir()) == before


def _layout_dir(root: Path, name: str) -> Path:
    plan = layout("gpt2-tiny", name)
    d = root / name
    d.mkdir(parents=True)
    (d / "plan.json").write_text(plan.to_json())
    (d / "program_torch.py").write_text(emit_torch(plan, "gpt2-tiny"))
    return d


def test_resume_tp_pipeline_checkpoint_under_fsdp(tmp_path: Path) -> None:
    src, dst = _layout_dir(tmp_path, "pp_tp"), _layout_dir(tmp_path, "zero3")
    full = run(src, 3, "--checkpoint-every", "2")
    res = run(dst, 3, "--resume", "--", "--checkpoint-dir", str(src / "checkpoints"))
    assert res["start_step"] == 2 and res["losses_all"][:2] == full["losses"][:2]
    assert res["losses"][0] == pytest.approx(full["losses"][2], rel=RTOL, abs=0)
