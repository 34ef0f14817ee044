"""Faults under torchrun: a rank killed mid-training costs nothing beyond the last checkpoint.

One 4-rank plan (mlp, 4xCPU, searched by ``partita compile``) trains 6 steps with a checkpoint every
2 steps. The test hook in ``backends/torch/train.py`` kills one rank on the first attempt only
(``PARTITA_FAULT_AT_STEP`` / ``_KIND`` / ``_RANK``); with ``partita run --max-restarts 1`` torchrun
restarts the group, the program resumes from the newest checkpoint of this run, and the losses of
every step equal the uninterrupted run's exactly (float ==: same ranks, same reduction order, the
checkpoint restores model, Adam state and LR schedule bit for bit). A kill between writing a
checkpoint and publishing it leaves only a ``.tmp-`` directory: the previous checkpoint stays the
newest readable one, loads, and a ``--resume`` from it again reproduces the uninterrupted losses.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
from pathlib import Path

import pytest

from partita.cli import main

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]
STEPS, EVERY = 6, 2


def cli(*argv: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    """``partita ARGV`` in-process with extra environment; (exit code, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    saved = dict(os.environ)
    os.environ.update({"OMP_NUM_THREADS": "1", **(env or {})})
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = main(list(argv))
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return rc, out.getvalue(), err.getvalue()


def train(plan_dir: Path, *extra: str, env: dict[str, str] | None = None) -> dict:
    rc, out, err = cli("run", str(plan_dir), "--steps", str(STEPS), "--json", *extra, env=env)
    assert rc == 0, err[-3000:]
    return json.loads(out)


@pytest.fixture(scope="module")
def compiled(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("faults")
    argv = ("compile", "mlp", "--cluster", "4xCPU", "--global-batch", "64", "--seq", "32", "--dtype", "f32")
    rc, _, err = cli(*argv, "--out", str(root / "plan"), env={"PARTITA_CACHE_DIR": str(root / "cache")})
    assert rc == 0, err
    assert json.loads((root / "plan" / "plan.json").read_text())["stages"][0]["dp"] == 4
    return root / "plan"


def fresh(compiled: Path, tmp_path: Path) -> Path:
    """A copy of the compiled plan with no checkpoints yet."""
    shutil.copytree(compiled, tmp_path / "plan")
    return tmp_path / "plan"


@pytest.fixture(scope="module")
def baseline(compiled: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    plan = fresh(compiled, tmp_path_factory.mktemp("baseline"))
    res = train(plan, "--checkpoint-every", str(EVERY), "--reference")
    assert res["restart_count"] == 0 and res["start_step"] == 0 and len(res["losses"]) == STEPS
    assert res["losses_all"] == res["losses"]
    for got, ref in zip(res["losses"], res["reference_losses"]):  # sanity: the plan trains the model
        assert got == pytest.approx(ref, rel=1e-5)
    res["checkpoints"] = plan / "checkpoints"
    return res


@pytest.mark.parametrize(
    "kind, step, rank",
    [("raise", 5, 1), ("sigkill", 3, 2)],
    ids=["raise-at-step5-rank1", "sigkill-at-step3-rank2"],
)
def test_killed_rank_restarts_from_checkpoint(
    compiled: Path, baseline: dict, tmp_path: Path, kind: str, step: int, rank: int
) -> None:
    fault = {"PARTITA_FAULT_AT_STEP": str(step), "PARTITA_FAULT_KIND": kind, "PARTITA_FAULT_RANK": str(rank)}
    res = train(fresh(compiled, tmp_path), "--checkpoint-every", str(EVERY), "--max-restarts", "1", env=fault)
    resumed = (step - 1) // EVERY * EVERY  # the newest checkpoint published before the fault
    assert res["restart_count"] == 1 and res["start_step"] == resumed
    assert res["resumed_from"].endswith(f"step-{resumed:06d}")
    assert res["losses"] == baseline["losses"][resumed:]  # exactly: recomputed after the restore
    assert res["losses_all"] == baseline["losses"]


def test_kill_during_save_keeps_previous_checkpoint(compiled: Path, baseline: dict, tmp_path: Path) -> None:
    import torch

    from partita.backends.torch import checkpoint
    from partita.backends.torch.train import make_optimizer
    from partita.models.zoo import resolve_model

    plan = fresh(compiled, tmp_path)
    fault = {"PARTITA_FAULT_AT_STEP": "4", "PARTITA_FAULT_KIND": "sigkill_in_save", "PARTITA_FAULT_RANK": "0"}
    rc, _, err = cli("run", str(plan), "--steps", str(STEPS), "--checkpoint-every", str(EVERY), env=fault)
    assert rc == 1 and "Traceback" not in err.split("partita: error:")[0], err[-2000:]
    assert "rank 0, exit code -9 (SIGKILL)" in err, err[-2000:]
    ck = plan / "checkpoints"
    names = sorted(p.name for p in ck.iterdir())
    assert names == [".tmp-step-000004", "step-000002"], names  # step 4's data written, never published
    assert (ck / ".tmp-step-000004" / ".metadata").exists()
    assert checkpoint.latest(ck) == (2, ck / "step-000002")

    # the previous checkpoint is readable: load it outside any process group and compare with the
    # checkpoint the uninterrupted run published at the same step
    def loaded(path: Path) -> dict[str, torch.Tensor]:
        handle = resolve_model("mlp")
        model = handle.build("cpu", seed=123).float()
        opt = make_optimizer(model.parameters(), {"optimizer": "adam"})
        assert checkpoint.load(path, model, opt) == 2
        return {k: v.clone() for k, v in model.state_dict().items()}

    got, want = loaded(ck / "step-000002"), loaded(baseline["checkpoints"] / "step-000002")
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in got)
    assert checkpoint.read_meta(ck / "step-000002")["losses"] == baseline["losses"][:2]

    res = train(plan, "--checkpoint-every", str(EVERY), "--resume")
    assert res["start_step"] == 2 and res["losses"] == baseline["losses"][2:]
    assert res["losses_all"] == baseline["losses"]
    assert sorted(p.name for p in ck.iterdir()) == ["step-000002", "step-000004", "step-000006"]


def test_fresh_run_refuses_a_directory_of_another_run(compiled: Path, baseline: dict, tmp_path: Path) -> None:
    """Catalogue case ``stale-checkpoint-dir``: saving beside another run's checkpoints would let a
    later restart or --resume pick them up; the program refuses before the first step."""
    plan = fresh(compiled, tmp_path)
    shutil.copytree(baseline["checkpoints"], plan / "checkpoints")
    before = sorted(p.name for p in (plan / "checkpoints").iterdir())
    rc, _, err = cli("run", str(plan), "--steps", "2", "--checkpoint-every", "1")
    flat = " ".join(err.split())
    assert rc == 2 and "Traceback" not in err, err[-2000:]
    assert "already holds step-000006 from another run" in flat and "--resume" in flat, flat
    assert sorted(p.name for p in (plan / "checkpoints").iterdir()) == before
