"""Reports: terminal text is deterministic (golden), HTML renders in a real headless Chromium."""

import dataclasses
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from partita.plan import Plan
from partita.report import compare_text, plan_html, plan_text, run_log, run_log_text
from tests.test_plan import make_plan

GOLDEN = Path(__file__).parent / "golden" / "report_small_plan.txt"
GOLDEN_DIR = Path(__file__).parent / "golden"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
LAYOUT_JS = Path(__file__).parent / "report_layout.js"


def _golden(path: Path, text: str) -> None:
    if os.environ.get("UPDATE_GOLDEN"):
        path.write_text(text)
    assert text == path.read_text(), f"{path.name} differs (UPDATE_GOLDEN=1 regenerates it on purpose)"


def _flat(text: str) -> str:
    """Table text without borders, whitespace collapsed: a phrase wrapped inside one cell reads whole."""
    return " ".join("".join(" " if ch in "│┃┌┐└┘├┤┬┴┼─━┏┓┗┛┡┩╇┳┻╋" else ch for ch in text).split())


def _assert_no_table_cropped(text: str) -> None:
    """Every table row ends with its right border: rich crops a table wider than the console."""
    for line in text.splitlines():
        if line[:1] in "┏┃┡│└┌├":
            assert line[-1] in "┓┃┩│┘┐┤", f"cropped: {line!r}"


def wide_plan() -> Plan:
    """make_plan() grown to what the issue saw: a 40-device cluster spec, 32 micro-batches, long layer
    names, memory close to capacity (where labels used to be clipped), a run's worth of alternatives."""
    base = make_plan()
    gib = 2**30
    groups = [
        {"device": {"name": "A100-80G", "memory_bytes": 80 * gib}, "num_nodes": 2, "gpus_per_node": 8},
        {"device": {"name": "V100-32G", "memory_bytes": 32 * gib}, "num_nodes": 2, "gpus_per_node": 8},
        {"device": {"name": "L4", "memory_bytes": 24 * gib}, "num_nodes": 1, "gpus_per_node": 8},
    ]
    names = ["embed", "transformer.h.0", "transformer.h.1", "lm_head_and_loss"]
    s0, s1 = base.stages
    stages = (
        dataclasses.replace(
            s0,
            layers=tuple(names[:2]),
            predicted={
                "compute_s": 0.06,
                "comm_s": 0.004,
                "tail_s": 0.0021,
                "forward_s": 0.02,
                "memory_bytes": 78.9 * gib,
            },
        ),
        dataclasses.replace(
            s1,
            layers=tuple(names[2:]),
            predicted={
                "compute_s": 0.045,
                "comm_s": 0.0,
                "tail_s": 0.0,
                "forward_s": 0.015,
                "memory_bytes": 31.5 * gib,
            },
        ),
    )
    alts = [
        {
            "summary": "dp=8 b=1 m=64 1f1b [2u A100-80G 8x1 z1 none] [2u V100-32G+L4 8x1 z0 selective]",
            "step_time_s": 2.41,
            "why": "slower by 12.3% mostly because of more bubble (+0.25 s)",
        }
    ]
    return dataclasses.replace(
        base,
        stages=stages,
        model={"name": "gpt-with-a-rather-long-name", "layers": names},
        cluster={"name": "mixed-lab", "spec": {"groups": groups}},
        num_micro_batches=32,
        predicted={
            "step_time_s": 2.15,
            "compute_s": 1.92,
            "communication_s": 0.13,
            "bubble_s": 0.1,
            "mfu": 0.41,
            "tokens_per_s": 61.0,
        },
        search={"alternatives": alts, "num_candidates": 1234, "ilp": {"num_solves": 3, "memo_hits": 1}},
    )


def test_text_report_golden() -> None:
    text = plan_text(make_plan(), width=110)
    _golden(GOLDEN, text)
    for part in ("Stages", "Time breakdown", "Top alternatives", "Search statistics", "V100-32G", "3:1"):
        assert part in text


@pytest.mark.parametrize("width", [80, 160])
def test_text_report_fits_width_and_wraps(width: int) -> None:
    """Golden at 80 and 160 columns; no line wider than the terminal, no truncated word."""
    text = plan_text(wide_plan(), width=width)
    _golden(GOLDEN_DIR / f"report_wide_plan_{width}.txt", text)
    assert max(len(line) for line in text.splitlines()) <= width
    assert "…" not in text  # rich's truncation mark: names and headers wrap instead
    _assert_no_table_cropped(text)
    flat = _flat(text)
    phrases = ("6 of 40 devices", "2 stages", "32 micro-batches of 2 samples per replica", "per micro-batch",
               "per step", "not used: 12 x A100-80G, 14 x V100-32G, 8 x L4")  # fmt: skip
    for phrase in phrases:
        assert phrase in flat, phrase
    if width == 160:
        assert "lm_head_and_loss" in text


def test_stage_table_layout_depends_on_width() -> None:
    assert "Stages: layout" in plan_text(wide_plan(), width=80)
    assert "Stages: layout" not in plan_text(wide_plan(), width=160)


def test_width_from_columns_and_fixed_when_piped(monkeypatch) -> None:
    from partita.report import fmt

    monkeypatch.setenv("COLUMNS", "200")
    assert fmt.output_width() == 200
    wide = plan_text(wide_plan())
    assert max(len(line) for line in wide.splitlines()) > 160
    monkeypatch.delenv("COLUMNS")
    monkeypatch.setattr("sys.stdout.isatty", lambda: False)
    assert fmt.output_width() == fmt.WIDTH


def test_plurals_and_units() -> None:
    from partita.report.fmt import nbytes, plural

    assert [plural(1, "stage"), plural(2, "stage"), plural(1, "micro-batch", "micro-batches")] == [
        "1 stage",
        "2 stages",
        "1 micro-batch",
    ]
    assert [nbytes(0), nbytes(None), nbytes(512), nbytes(4096), nbytes(3 * 2**20)] == [
        "-",
        "-",
        "512 B",
        "4.0 KiB",
        "3.00 MiB",
    ]
    one = dataclasses.replace(make_plan(), num_micro_batches=1)
    flat = _flat(plan_text(one, width=160))
    assert "1 micro-batch of 2 samples per replica" in flat and "1 micro-batches" not in flat


def test_compare() -> None:
    text = compare_text(make_plan(), wide_plan(), width=80)
    assert "Plan comparison" in text and text.endswith("A has 6.3x the throughput of B (384 vs 61 tokens/s)\n")
    near = dataclasses.replace(make_plan(), predicted={"step_time_s": 0.3})  # same batch: 16 x 8 / 0.3 s
    assert compare_text(make_plan(), near, width=80).endswith(
        "B has 11.1% more throughput than A (427 vs 384 tokens/s)\n"
    )


def test_evaluate_text_is_readable() -> None:
    from partita.report import evaluate_text

    ev = {
        "predicted_step_time_s": 1.5,
        "pipeline_s": 1.4,
        "bubble_s": 0.2,
        "tail_s": 0.1,
        "stage_times_s": (0.3, 0.31),
        "memory_per_device": (38780805152.0, 40e9),
        "memory_capacity": 39e9,
        "fits": False,
        "tokens_per_s": 43690.7,
    }
    text = evaluate_text(ev, width=100)
    assert "38780805152" not in text and "(" + "38780805152.0" not in text
    assert "36.12 GiB" in text and "DOES NOT FIT" in text and "NO" in text and "1.500 s per step" in text


def _chromium(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
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
        "--hide-scrollbars",
        f"--user-data-dir={tmp_path / ('profile-' + str(abs(hash(args))))}",
        "--enable-logging=stderr",
        "--v=0",
    ]
    return subprocess.run([*flags, *args], capture_output=True, text=True, timeout=120)


def _measure(tmp_path: Path, page_html: str, width: int, name: str) -> dict:
    """Load the page at ``width`` px in headless Chromium with tests/report_layout.js injected; its
    measured boxes (problems, chart sizes) as a dict; also a screenshot at that width."""
    import json
    import re

    page = tmp_path / f"{name}.html"
    page.write_text(page_html.replace("</body>", f"<script>{LAYOUT_JS.read_text()}</script></body>"))
    dom = _chromium(tmp_path, f"--window-size={width},1600", "--dump-dom", page.as_uri())
    assert dom.returncode == 0, dom.stderr[-2000:]
    console = [ln for ln in dom.stderr.splitlines() if "Uncaught" in ln]
    assert not console, console
    m = re.search(r'<pre id="layout-result">(.*?)</pre>', dom.stdout)
    assert m, "the layout script did not run"
    shot = tmp_path / f"{name}-{width}.png"
    r = _chromium(tmp_path, f"--screenshot={shot}", f"--window-size={width},1600", page.as_uri())
    assert r.returncode == 0 and shot.exists() and shot.stat().st_size > 10_000, r.stderr[-2000:]
    out = json.loads(html_unescape(m.group(1)))
    out["dom"] = dom.stdout
    return out


def html_unescape(s: str) -> str:
    import html

    return html.unescape(s)


def _need_chromium() -> None:
    if CHROMIUM is None:
        if os.environ.get("CI"):
            pytest.fail("chromium is missing in CI: scripts/test.sh installs it (apt-get install chromium)")
        pytest.skip("chromium not installed (scripts/test.sh installs it)")


@pytest.mark.slow
@pytest.mark.parametrize("width", [700, 1400])
def test_html_in_headless_chromium(tmp_path: Path, width: int) -> None:
    """The page at 700 and 1400 px: all charts drawn, no text outside the window or its chart, no
    clipped box, no overlapping axis ticks; screenshots under tmp_path (look at them when changing
    the page)."""
    _need_chromium()
    plan = wide_plan()
    got = _measure(tmp_path, plan_html(plan, run_log.build(plan, _torch_result(), steps=3, framework="torch")),
                   width, "report")  # fmt: skip
    assert 'data-charts="ok"' in got["dom"], "charts did not render"
    assert got["problems"] == [], got["problems"]
    charts = got["charts"]
    assert set(charts) == {"timeline", "memory", "breakdown", "layermap"}
    assert charts["timeline"]["boxes"] == 2 * 2 * 32  # forward + backward of 32 micro-batches on 2 stages
    assert charts["timeline"]["ticks"] >= 3 and charts["timeline"]["legend"] == 3
    assert charts["layermap"]["boxes"] == 4
    assert all(c["width"] <= width for c in charts.values())
    assert "78.90 GiB of 80.00 GiB usable per device" in got["dom"]  # the label that was clipped, whole
    for section in ('id="why"', 'id="next"', 'id="utilization"'):  # issue 35: why, next commands, busy types
        assert section in got["dom"], section
    assert 'id="runlog-causes"' in got["dom"]


@pytest.mark.slow
def test_layout_check_catches_overflow(tmp_path: Path) -> None:
    """The measuring script is not blind: a page with a too-wide label and a clipped chart fails it."""
    _need_chromium()
    bad = plan_html(make_plan()).replace(
        '<figure class="chart" id="memory">',
        '<figure class="chart" id="memory"><div style="width:2000px;white-space:nowrap">too wide</div>'
        '<div style="width:50px;overflow:hidden;white-space:nowrap">a label cut at the edge of its box</div>',
    )
    got = _measure(tmp_path, bad, 700, "bad")
    text = " ".join(got["problems"])
    assert "leaves the window" in text and "clipped" in text and "page scrolls sideways" in text


@pytest.mark.slow
def test_compare_html_holds_both_plans(tmp_path: Path) -> None:
    _need_chromium()
    from partita.report import compare_html

    page = compare_html([make_plan(), wide_plan()])
    assert page.count('class="chart" id="A-timeline"') == 1 and page.count('class="chart" id="B-timeline"') == 1
    got = _measure(tmp_path, page, 700, "compare")
    assert got["problems"] == [], got["problems"]
    assert len(got["charts"]) == 8
    # one time axis for both pipeline charts (issue 35): the same ticks, the shorter step's boxes end early
    axes = [page.split(f'id="{k}-timeline"')[1].split('class="axis">')[1].split("</div></div>")[0] for k in "AB"]
    assert axes[0] == axes[1] and "shared with the other plan" in page


# ---- run logs: predicted vs measured -----------------------------------------------------------
RUN_LOG_GOLDEN = Path(__file__).parent / "golden" / "report_run_log.txt"


def _torch_result() -> dict:
    """A result shaped like ``torch_launch.run``'s (keys and nesting of torch_train._report)."""
    return {
        "losses": [2.5, 2.25, 2.0],
        "reference_losses": [2.5, 2.25, 2.0000001],
        "step_time_s": [0.9, 0.4, 0.5],
        "collectives": {
            "stage0": {"all_reduce@tp": {"count": 3, "bytes": 7.5e6}},
            "stage1": {"p2p@pp": {"count": 8, "bytes": 4096}},
        },
        "predicted_step_time_s": 1 / 3,
    }


def test_run_log_numbers_and_golden() -> None:
    plan = make_plan()
    log = run_log.build(plan, _torch_result(), steps=3, framework="torch")
    st = log["step_time_s"]
    assert st["measured_median"] == 0.5 and st["error"] == pytest.approx((0.5 - 1 / 3) / (1 / 3))
    s0, s1 = log["stages"]
    assert s0["collectives"]["all_reduce@tp"] == {
        "predicted": {"count": 2, "bytes": 3e6},  # Collective(bytes=1.5e6, count=2): bytes per call x calls
        "measured": {"count": 3, "bytes": 7.5e6},
    }
    assert s0["collective_mismatches"] == ["all_reduce@tp: measured 3, predicted 2"]
    assert s1["collective_mismatches"] == ["p2p@pp: measured 8, predicted 0"]
    # equal counts are not enough: bytes must agree within 2% (issue 15: 463 KiB vs 431 KiB is no match)
    near = dict(_torch_result(), collectives={"stage0": {"all_reduce@tp": {"count": 2, "bytes": 3.05e6}}})
    far = dict(_torch_result(), collectives={"stage0": {"all_reduce@tp": {"count": 2, "bytes": 3.22e6}}})
    assert run_log.build(plan, near, steps=3, framework="torch")["stages"][0]["collective_mismatches"] == []
    assert run_log.build(plan, far, steps=3, framework="torch")["stages"][0]["collective_mismatches"] == [
        "all_reduce@tp: measured 3220000 B, predicted 3000000 B"
    ]
    assert (run_log.median([3, 1, 2]), run_log.median([4, 1, 2, 3]), run_log.median([])) == (2, 2.5, None)
    log["machine"] = {"num_cpus": 2, "load_avg_1m_before": 3.5}  # as recorded on a loaded 2-core machine
    section = run_log_text(log, width=110)
    _golden(RUN_LOG_GOLDEN, section)
    for part in ("Predicted vs measured", "333.3 ms", "500.0 ms (median of 3)", "+50.0%", "NO", "max |diff| 1.0e-07"):
        assert part in section, part
    full = plan_text(plan, log, width=110)
    assert full.startswith(plan_text(plan, width=110)) and full.endswith(section)
    page = plan_html(plan, log)
    assert 'id="runlog"' in page and "+50.0%" in page
    assert 'id="runlog"' not in plan_html(plan)


def test_run_log_gap_names_causes_and_fixes() -> None:
    """A gap over 25% names its likely causes with the command that fixes each; a small one names none."""
    plan = wide_plan()  # its cluster spec records no calibration profile for either device type
    log = run_log.build(plan, _torch_result(), steps=3, framework="torch", load_before=3.5)
    log["machine"]["num_cpus"] = 2
    log["plan_dir"] = "out/x"
    log["step_time_s"]["error"] = 15.0  # +1500%, as the issue saw
    causes = dict(run_log.gap_causes(log))
    assert any("no calibration profile for A100-80G" in c for c in causes)
    assert any("partita profile --devices cuda --nproc 4" in f for f in causes.values())
    assert any("load average 3.5 on 2 cores" in c for c in causes)
    assert "rerun when the machine is idle: `partita run out/x`" in causes.values()
    text = " ".join(run_log_text(log, width=100).split())
    assert "Why the step time is off by +1500.0%" in text and "partita profile --devices cuda" in text
    log["step_time_s"]["error"] = 0.2
    assert run_log.gap_causes(log) == [] and "Why the step time" not in run_log_text(log, width=100)
    log["step_time_s"]["error"] = -0.4  # faster than predicted is a gap too
    log["machine"]["load_avg_1m_before"] = 0.1
    causes = dict(run_log.gap_causes(log))
    assert not any("loaded" in c for c in causes) and any("calibration" in c for c in causes)


def test_run_log_cpu_ranks_over_cores_is_a_cause() -> None:
    plan = make_plan()
    log = run_log.build(plan, _torch_result(), steps=3, framework="torch", load_before=0.0)
    log["devices"] = {"CPU": {"kind": "cpu", "profile": "p.json", "num_ranks": 4}}
    log["machine"] = {"num_cpus": 2, "load_avg_1m_before": 0.0}
    ((cause, fix),) = run_log.gap_causes(log)
    assert "4 CPU ranks shared 2 cores" in cause and "--cluster 2xCPU" in fix


def test_run_log_shows_the_program_comparison_with_bytes() -> None:
    """A torch program predicts the plan's records (kind@axis, count, bytes): a row with equal counts
    and bytes 7% apart is no match, in the table too."""
    plan = make_plan()
    result = dict(_torch_result(), predicted_collectives={"stage0": {"all_reduce@tp": {"count": 3, "bytes": 7e6}}},
                  collectives={"stage0": {"all_reduce@tp": {"count": 3, "bytes": 7.5e6}}},
                  collective_mismatches={"stage0": ["all_reduce@tp: measured 7500000 B, predicted 7000000 B"]})  # fmt: skip
    log = run_log.build(plan, result, steps=3, framework="torch")
    assert log["stages"][0]["collective_mismatches"] == ["all_reduce@tp: measured 7500000 B, predicted 7000000 B"]
    text = run_log_text(log, width=110)
    row = next(line for line in text.splitlines() if "all_reduce" in line)
    cells = [c.strip() for c in row.strip("│ ").split("│")]
    assert cells == ["0", "all_reduce@tp", "3", "3", "6.68 MiB", "7.15 MiB", "NO"], cells


@pytest.mark.multiprocess
@pytest.mark.serial  # failed once beside another worker (scripts/test.sh runs it alone)
def test_partita_run_writes_run_log_and_report_reads_it(tmp_path, monkeypatch) -> None:
    """A real 2-rank run: run_log.json holds the launcher's numbers; `partita report DIR` shows them."""
    import json

    from partita.driver import compile_to_dir, report, run_plan
    from partita.search.pricing.config import TrainingConfig

    monkeypatch.setenv("PARTITA_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("COLUMNS", "160")  # at 80 a measured "19.1 ms (median of 3)" folds in its cell
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


def test_timeline_axis_and_missing_predictions_read_plainly() -> None:
    """Axis ticks are plain numbers with a unit (no 1e+04); a stage the plan has no time or memory
    for is drawn at the others' mean and says it has no prediction, not "0.00 GiB"."""
    import re

    from partita.report.html import memory_html, timeline_html

    wide = wide_plan()
    slow = tuple(dataclasses.replace(st, predicted={**st.predicted, "forward_s": 0.2}) for st in wide.stages)
    for plan, unit in ((make_plan(), "ms"), (dataclasses.replace(wide, stages=slow), "s")):  # 1.95 s, ~20 s
        ticks = re.findall(r'class="tick[^>]*>([^<]*)<', timeline_html(plan))
        assert len(ticks) >= 3 and all(re.fullmatch(rf"[\d,.]+ {unit}", t) for t in ticks), ticks
    assert "no memory prediction in the plan (capacity" not in memory_html(make_plan())  # no spec: no capacity
    assert "stage 1 (V100-32G): no memory prediction in the plan" in memory_html(make_plan())


@pytest.mark.slow
@pytest.mark.parametrize("width", [700, 1400])
def test_chart_box_labels_in_headless_chromium(tmp_path: Path, width: int) -> None:
    """Issue 35: micro-batch labels inside the chart's boxes (8 micro-batches on 2 stages: wide enough)
    fit their boxes at 700 and 1400 px: no text clipped, leaving its chart or the window."""
    import re

    from partita.cluster import parse_cluster
    from partita.frontends.trace import trace_handle
    from partita.models import resolve_model
    from partita.search.entry.hand_plan import hand_plan
    from partita.search.pricing.config import TrainingConfig

    _need_chromium()
    graph = trace_handle(resolve_model("gpt2-tiny"), batch=1, seq=32)
    cl, tr = parse_cluster("2xA100-80G"), TrainingConfig(global_batch=8, seq_len=32)
    plan = hand_plan(graph, cl, tr, tp=1, pp=2, dp=1, micro_batch=1, schedule="1f1b")
    got = _measure(tmp_path, plan_html(plan), width, "labels")
    assert got["problems"] == [], got["problems"]
    assert re.search(r'title="stage 1 \(rank group 1\), micro-batch 7: forward [^"]*">7</div>', got["dom"])
