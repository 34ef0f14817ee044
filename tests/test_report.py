"""Reports: terminal text is deterministic (golden), HTML renders in a real headless Chromium."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from partita.report import compare_text, plan_html, plan_text
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
