"""End to end: a plan found by the search for 4 CPU ranks trains under torchrun, matches the seeded
single-device run, and the collectives that ran equal the plan's predicted ones."""

import json

import pytest

from partita.cli import main


@pytest.mark.multiprocess
def test_compile_then_run_matches_reference(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.setenv("PARTITA_CACHE_DIR", str(tmp_path / "cache"))
    out = tmp_path / "plan"
    assert (
        main(
            [
                "compile",
                "mlp",
                "--cluster",
                "4xCPU",
                "--global-batch",
                "64",  # at 16 samples the tiny MLP is launch-bound and one rank is (rightly) fastest
                "--seq",
                "32",
                "--dtype",
                "f32",
                "--out",
                str(out),
                "--json",
            ]
        )
        == 0
    )
    compiled = json.loads(capsys.readouterr().out)
    assert compiled["world_size"] >= 2 and (out / "program_torch.py").exists()
    assert main(["run", str(out), "--steps", "3", "--reference", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert len(res["losses"]) == 3
    for got, ref in zip(res["losses"], res["reference_losses"]):
        assert got == pytest.approx(ref, rel=1e-4, abs=1e-5)
    assert all(not m for m in res["collective_mismatches"].values()), res["collective_mismatches"]
    assert res["predicted_step_time_s"] > 0 and len(res["step_time_s"]) == 3
