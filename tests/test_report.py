"""Reports: terminal text is deterministic (golden), HTML renders in a real headless Chromium."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from partita.report import compare_text, plan_html, plan_text, run_log, run_log_text
from tests.test_plan import make_plan

GOLDEN = Path(__file__).parent / "golden" / "report_small_plan.txt"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def test_text_report_golden() -> None:
    text = plan_text(make_plan())
    if os.environ.get("UPDATE_GOLDEN"):
        GOLDEN.parent.mkdir(exist_ok=True)
        GOLDEN.write_text(text)
    assert text == GOLDEN.read_text()
    for part in ("Stages", "Time breakdown", "Top alternatives", "Search statistics", "V100-32G", "3:1"):
        assert part in text


def test_compare() -> None:
    assert "Plan comparison" in compare_text(make_plan(), make_plan())


@pytest.mark.slow
def test_html_in_headless_chromium(tmp_path: Path) -> None:
    if CHROMIUM is None:
        if os.environ.get("CI"):
            pytest.fail("chromium is missing in CI: scripts/test.sh installs it (apt-get install chromium)")
        pytest.skip("chromium not installed (scripts/test.sh installs it)")
    page = tmp_path / "report.html"
    page.write_text(plan_html(make_plan()))
    flags = [
        CHROMIUM,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--user-data-dir={tmp_path / 'profile'}",
        "--enable-logging=stderr",
        "--v=0",
    ]
    dom = subprocess.run([*flags, "--dump-dom", page.as_uri()], capture_output=True, text=True, timeout=120)
    assert dom.returncode == 0, dom.stderr[-2000:]
    assert 'data-charts="ok"' in dom.stdout, "charts did not render"
    for chart in ('id="timeline"', 'id="memory"', 'id="breakdown"', 'id="layermap"'):
        assert chart in dom.stdout
    console = [ln for ln in dom.stderr.splitlines() if "CONSOLE" in ln or "Uncaught" in ln]
    assert not console, console
    shot = tmp_path / "report.png"
    r = subprocess.run(
        [*flags, f"--screenshot={shot}", "--window-size=1200,1600", page.as_uri()],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0 and shot.exists() and shot.stat().st_size > 10_000, r.stderr[-2000:]


# ---- run logs: predicted vs measured -----------------------------------------------------------
RUN_LOG_GOLDEN = Path(__file__).parent / "golden" / "report_run_log.txt"


def _torch_result() -> dict:
    """A result shaped like ``torch_launch.run``'s (keys and nesting of torch_train._report)."""
    return {
        "losses": [2.5, 2.25, 2.0],
        "reference_losses": [2.5, 2.25, 2.0000001],
        "step_time_s": [0.9, 0.4, 0.5],
        "collectives": {
            "stage0": {"all_reduce": {"count": 3, "bytes": 7.5e6}},
            "stage1": {"p2p": {"count": 8, "bytes": 4096}},
        },
        "predicted_step_time_s": 1 / 3,
    }


def test_run_log_numbers_and_golden() -> None:
    plan = make_plan()
    log = run_log.build(plan, _torch_result(), steps=3, framework="torch")
    st = log["step_time_s"]
    assert st["measured_median"] == 0.5 and st["error"] == pytest.approx((0.5 - 1 / 3) / (1 / 3))
    s0, s1 = log["stages"]
    assert s0["collectives"]["all_reduce"] == {
        "predicted": {"count": 2, "bytes": 3e6},  # Collective(bytes=1.5e6, count=2): bytes per call x calls
        "measured": {"count": 3, "bytes": 7.5e6},
    }
    assert s0["collective_mismatches"] == ["all_reduce: measured 3, predicted 2"]
    assert s1["collective_mismatches"] == ["p2p: measured 8, predicted 0"]
    assert (run_log.median([3, 1, 2]), run_log.median([4, 1, 2, 3]), run_log.median([])) == (2, 2.5, None)
    section = run_log_text(log)
    if os.environ.get("UPDATE_GOLDEN"):
        RUN_LOG_GOLDEN.write_text(section)
    assert section == RUN_LOG_GOLDEN.read_text()
    for part in ("Predicted vs measured", "333.3 ms", "500.0 ms (median of 3)", "+50.0%", "NO", "max |diff| 1.0e-07"):
        assert part in section, part
    full = plan_text(plan, log)
    assert full.startswith(plan_text(plan)) and full.endswith(section)
    page = plan_html(plan, log)
    assert 'id="runlog"' in page and "+50.0%" in page
    assert 'id="runlog"' not in plan_html(plan)


@pytest.mark.multiprocess
def test_partita_run_writes_run_log_and_report_reads_it(tmp_path, monkeypatch) -> None:
    """A real 2-rank run: run_log.json holds the launcher's numbers; `partita report DIR` shows them."""
    import json

    from partita.driver import compile_to_dir, report, run_plan
    from partita.search.config import TrainingConfig

    monkeypatch.setenv("PARTITA_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    out = tmp_path / "plan"
    compiled = compile_to_dir("mlp", "2xCPU", TrainingConfig(global_batch=64, seq_len=1, dtype="f32"), out)
    assert compiled.plan.world_size == 2
    assert "Predicted vs measured" not in report([str(out)])  # no run yet, no section
    result = run_plan(str(out), steps=3, reference=True)
    log = json.loads((out / run_log.RUN_LOG_FILE).read_text())
    assert log["result"]["losses"] == result["losses"] and log["losses"] == result["losses"]
    assert log["step_time_s"]["measured"] == result["step_time_s"]
    assert log["step_time_s"]["measured_median"] == sorted(result["step_time_s"])[1]
    # the plan file (which the run reads) keeps 9 significant digits (plan.py)
    assert log["step_time_s"]["predicted"] == pytest.approx(compiled.plan.predicted["step_time_s"], rel=1e-8)
    for s, stage in zip(log["stages"], compiled.plan.stages):
        measured = result["collectives"][f"stage{stage.index}"]
        assert {k: v["measured"] for k, v in s["collectives"].items() if v["measured"]} == measured
    text = report([str(out)], html=str(tmp_path / "page.html"))
    med = log["step_time_s"]["measured_median"]
    assert "Predicted vs measured (torch run, 3 steps)" in text and f"{med * 1e3:.1f} ms (median of 3)" in text
    assert 'id="runlog"' in (tmp_path / "page.html").read_text()
