"""The report's pipeline chart is the plan's action list as the cost model simulated it (issue 19)."""

from __future__ import annotations

from collections import Counter

import pytest

from partita.cluster import parse_cluster
from partita.plan import Plan
from partita.report.html import _KINDS, _schedule, timeline_html
from partita.search.pipeline.schedule import pipeline_actions, splits_backward
from partita.search.pricing.config import TrainingConfig


@pytest.fixture(scope="module")
def plans() -> dict[str, Plan]:
    from partita.frontends.trace import trace_handle
    from partita.models import resolve_model
    from partita.search.entry.hand_plan import hand_plan

    graph = trace_handle(resolve_model("gpt2-tiny"), batch=1, seq=32)
    cl, tr = parse_cluster("2xA100-80G"), TrainingConfig(global_batch=8, seq_len=32)
    return {s: hand_plan(graph, cl, tr, tp=1, pp=2, dp=1, micro_batch=1, schedule=s) for s in ("1f1b", "zb_h1")}


@pytest.mark.parametrize("schedule", ["1f1b", "zb_h1"])
def test_chart_draws_the_simulated_action_list(plans: dict[str, Plan], schedule: str) -> None:
    plan = plans[schedule]
    boxes, end, m = _schedule(plan)
    assert m == plan.num_micro_batches == 8
    assert end == pytest.approx(plan.predicted["step_time_s"] - plan.predicted["tail_s"], rel=1e-9)
    n = plan.num_stages
    kinds = Counter(a.kind for _, a, _, _ in boxes)
    assert kinds["F"] == kinds["B"] == n * m and kinds["W"] == (n * m if splits_backward(schedule) else 0)
    for rank, acts in enumerate(pipeline_actions(schedule, n, m)):
        assert [a for r, a, _, _ in sorted(boxes, key=lambda x: x[2]) if r == rank] == acts
    page = timeline_html(plan)
    legend = page.split('class="legend"')[1].split("</div>")[0]
    assert legend.count('class="sw"') == (4 if splits_backward(schedule) else 3)
    for kind, (colour, _what) in _KINDS.items():  # F, B, W in distinct colours, one box per action
        assert page.count(f"background:{colour};border") == kinds[kind]
    if splits_backward(schedule):
        idle = [end - sum(d for r, _, _, d in boxes if r == rank) for rank in range(n)]
        one = _schedule(plans["1f1b"])
        idle_1f1b = [one[1] - sum(d for r, _, _, d in one[0] if r == rank) for rank in range(n)]
        assert max(idle) < max(idle_1f1b)  # W fills part of the bubble


def test_terminal_summary_names_the_deferred_weight_gradients(plans: dict[str, Plan]) -> None:
    from partita.report.terminal import plan_text

    assert "weight gradients (W) deferred into the bubble" in plan_text(plans["zb_h1"], width=200)
    assert "deferred" not in plan_text(plans["1f1b"], width=200)


def test_chart_boxes_say_their_micro_batch_where_they_fit(plans: dict[str, Plan]) -> None:
    """Issue 35: the chart's boxes carry their micro-batch (and stage, on a rank group running several)
    as text, where it fits the track at a 700 px window; the tooltip of every box says the same."""
    import re

    from partita.report.html import MIN_TRACK_PX, box_label

    page = timeline_html(plans["1f1b"])
    boxes = re.findall(
        r'<div class="box" data-stage="(\d+)" style="[^"]*width:([\d.]+)%[^"]*" title="([^"]*)">([^<]*)</div>', page
    )
    assert len(boxes) == 2 * 2 * 8
    labelled = [(title, text) for _stage, _w, title, text in boxes if text]
    assert len(labelled) >= len(boxes) // 2  # 8 micro-batches on 2 stages: most boxes are wide enough
    for _stage, width, title, text in boxes:
        micro = re.search(r"micro-batch (\d+)", title)
        assert micro is not None
        assert text in ("", micro.group(1))
        if float(width) / 100 * MIN_TRACK_PX >= 6.5 + 4:
            assert text == micro.group(1)
    assert box_label(3, 2, 0.5) == "3 s2" and box_label(3, None, 0.5) == "3"
    assert box_label(12, 2, 0.005) == ""  # too narrow: the tooltip alone


def test_utilization_by_flops_per_device_type_adds_up_to_the_plans_mfu(plans: dict[str, Plan]) -> None:
    """Issue 35: per device type, the model FLOPs its stages run (the stage records) over the type's
    peak; weighted by the types' peaks they give the plan's MFU, which the search computes from the
    graph's FLOPs (an independent sum): here one type, so the two agree."""
    from partita.report.html import flops_utilization, utilization_html

    plan = plans["1f1b"]
    got = flops_utilization(plan)
    assert set(got) == {"A100-80G"}
    assert got["A100-80G"] == pytest.approx(plan.predicted["mfu"], rel=0.05)
    page = utilization_html(plan)
    assert "MFU of the type" in page and f"{100 * got['A100-80G']:.1f}%" in page
