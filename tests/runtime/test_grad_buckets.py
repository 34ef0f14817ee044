"""Issue 32 item 1: the ZeRO-0 gradient sync in buckets, overlapped with the stage's last backward.

What these tests prove (each fails on the code before ``Stage.grad_buckets``):

* the plan: ``Stage.grad_buckets`` is written only when set (a plan without it reads and writes byte for
  byte as before and means the flat sync), round-trips, and is refused where the program cannot bucket;
* the buckets (``records.grad_buckets``): every parameter the stage holds exactly once, the last layer's
  first, each bucket at most the cap (or one larger parameter alone) and full (the next bucket's first
  parameter would pass the cap); their records are one ``all_reduce@dp`` per bucket in
  phase ``backward`` whose bytes add up to the flat sync's;
* the rehearsal (``rehearse_rank`` in this process, the program's own entry on a fake world): the bucketed
  program issues every bucket inside the backward and matches the plan, alone and as two pipelined stages
  (1F1B, ZB-H1); the same program with its hooks made inert (every bucket then issued by ``finish`` after
  the schedule, as a flat sync would be) fails the
  comparison, naming the phase; the flat program issues its sync outside the backward, and a plan that
  claims it for the backward fails;
* the search prices what the program runs: the torch program's ZeRO-0 sync overlapped (``stage_ranges``'
  non-flat formula, below the flat sync's exposed time) with the buckets in flight as the copy; a searched
  (hand) plan of dp > 1 at ZeRO-0 carries buckets; JAX keeps the flat sync.

Numerics (the bucketed program equals the single-device run) are in ``test_torch_multiprocess.py``
(``*_buckets`` layouts: one stage, a two-stage pipeline of dp=2 at 2 micro-batches, tp=2 x dp=2).
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import pytest

from partita.backends.torch import launch as torch_launch
from partita.backends.torch import rehearse
from partita.backends.torch.emit import emit_torch
from partita.backends.torch.grad_buckets import GradBuckets
from partita.errors import PlanError
from partita.plan import GRAD_BUCKET_BYTES, GRAD_BUCKETS_IN_FLIGHT, Plan
from partita.search.program import records
from tests.runtime.plans import BUCKET_TEST_BYTES, _graph, layout, with_records

os.environ.setdefault("OMP_NUM_THREADS", "1")
MODEL = "gpt2-tiny"


def _program(tmp: Path, plan: Plan) -> Any:
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "plan.json").write_text(plan.to_json())
    (tmp / "program_torch.py").write_text(emit_torch(plan, MODEL))
    return torch_launch.load_program(tmp)


def _dp(collectives: Any) -> list[Any]:
    return [c for c in collectives if c.kind == "all_reduce" and c.axis == "dp"]


# ---- the plan ---------------------------------------------------------------------------------------
def test_plan_field_written_only_when_set_and_refused_where_the_program_cannot_bucket() -> None:
    flat, bucketed = layout(MODEL, "dp"), layout(MODEL, "dp_buckets")
    assert "grad_buckets" not in flat.to_json()  # older plans stay byte-identical
    assert Plan.from_json(flat.to_json()).to_json() == flat.to_json()
    assert Plan.from_json(bucketed.to_json()) == bucketed
    assert len(bucketed.stages[0].grad_buckets) > 2
    d = json.loads(bucketed.to_json())
    d["stages"][0]["zero_stage"] = 1
    with pytest.raises(PlanError, match="gradient buckets"):
        Plan.from_dict(d)
    d = json.loads(bucketed.to_json())
    d["stages"][0]["grad_buckets"][1].append(d["stages"][0]["grad_buckets"][0][0])
    with pytest.raises(PlanError, match="twice"):
        Plan.from_dict(d)


def test_buckets_hold_every_parameter_once_last_layer_first() -> None:
    plan = layout(MODEL, "dp_buckets")
    s = plan.stages[0]
    names = [n for b in s.grad_buckets for n in b]
    facts = records.GraphFacts(_graph(MODEL))
    held = {facts.fqn(t) for layer in s.layers for t in facts.params.get(layer, [])}
    assert sorted(names) == sorted(held)
    assert names[0].startswith(("lm_head", "transformer.ln_f"))  # the head's parameters finish first
    assert names[-1].startswith(("transformer.wte", "transformer.wpe"))  # the embedding's last
    sizes = [c.bytes for c in _dp(s.collectives)]
    assert all(c.phase == "backward" for c in _dp(s.collectives)) and len(sizes) == len(s.grad_buckets)
    numel = records._held_sizes(facts, plan, 0)
    for k, b in enumerate(s.grad_buckets):
        assert sizes[k] == 4 * sum(numel[n] for n in b)
        assert sizes[k] <= BUCKET_TEST_BYTES or len(b) == 1  # within the cap, or one larger parameter alone
        if k + 1 < len(s.grad_buckets):  # full: the next parameter would have passed the cap
            assert sizes[k] + 4 * numel[s.grad_buckets[k + 1][0]] > BUCKET_TEST_BYTES
    big = [b for b in s.grad_buckets if 4 * sum(numel[n] for n in b) > BUCKET_TEST_BYTES]
    assert big and all(len(b) == 1 for b in big)  # gpt2-tiny's larger matrices: a bucket each, synced in place
    flat = _dp(layout(MODEL, "dp").stages[0].collectives)
    assert [c.phase for c in flat] == ["optimizer"] and sum(sizes) == flat[0].bytes
    assert records.grad_buckets(_graph(MODEL), plan, 0) == (tuple(names),)  # 25 MiB: one bucket at this size


# ---- the rehearsal: where each bucket was issued -----------------------------------------------------
def _sync_problems(stage: Any, got: rehearse.RankResult) -> list[str]:
    return [m for m in rehearse.compare_stage(stage, [got])["mismatches"] if "@dp" in m]


def test_bucketed_program_syncs_inside_the_backward(tmp_path: Path) -> None:
    plan = layout(MODEL, "dp_buckets")
    got = rehearse.rehearse_rank(_program(tmp_path, plan), 0)
    n = len(plan.stages[0].grad_buckets)
    assert got.collectives["all_reduce@dp"]["count"] == n
    assert got.in_backward == {"all_reduce@dp": n}
    assert _sync_problems(plan.stages[0], got) == []
    assert rehearse.compare_stage(plan.stages[0], [got])["issued_in_backward"] == {"all_reduce@dp": n}  # the table's


@pytest.mark.parametrize("schedule", ["1f1b", "zb_h1"])
def test_pipelined_stages_sync_inside_the_backward(tmp_path: Path, schedule: str) -> None:
    # two stages of dp 2, 2 micro-batches: the hooks count accumulations through the pipeline runner's actions
    # (zb_h1: the W actions of a split backward make the weight gradients)
    plan = with_records(dataclasses.replace(layout(MODEL, "pp_dp_buckets"), schedule=schedule), MODEL)
    program = _program(tmp_path, plan)
    for s in plan.stages:
        got = rehearse.rehearse_rank(program, s.ranks[0])
        assert len(s.grad_buckets) > 1 and got.in_backward.get("all_reduce@dp") == len(s.grad_buckets)
        assert _sync_problems(s, got) == []


def test_program_syncing_after_the_schedule_fails_a_plan_that_says_backward(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    plan = layout(MODEL, "dp_buckets")
    monkeypatch.setattr(GradBuckets, "_accumulated", lambda self, p: None)  # finish() then issues every bucket
    got = rehearse.rehearse_rank(_program(tmp_path, plan), 0)
    assert got.collectives["all_reduce@dp"]["count"] == len(plan.stages[0].grad_buckets)  # same counts and bytes
    assert got.in_backward == {}
    problems = _sync_problems(plan.stages[0], got)
    assert len(problems) == 1 and "0 issued inside the backward" in problems[0], problems


def test_flat_program_syncs_after_the_schedule(tmp_path: Path) -> None:
    plan = layout(MODEL, "dp")
    got = rehearse.rehearse_rank(_program(tmp_path, plan), 0)
    assert got.in_backward == {} and got.collectives["all_reduce@dp"]["count"] == 1
    assert _sync_problems(plan.stages[0], got) == []
    s = plan.stages[0]
    claims = dataclasses.replace(
        s,
        collectives=tuple(
            dataclasses.replace(c, phase="backward") if c in _dp(s.collectives) else c for c in s.collectives
        ),
    )
    assert any("issued inside the backward" in m for m in _sync_problems(claims, got))


# ---- the search prices what the program runs ----------------------------------------------------------
def test_search_prices_the_buckets_overlapped() -> None:
    from partita.cluster import parse_cluster
    from partita.search.entry.hand_plan import hand_plan
    from partita.search.entry.planner import Search
    from partita.search.pipeline.stage_cost import StageFactors
    from partita.search.pipeline.stage_ranges import stage_parts
    from partita.search.pricing.config import SearchOptions, TrainingConfig

    graph, cl = _graph(MODEL), parse_cluster("8xH100-80G")  # A100: the shipped profile fits comm_overlap = 0
    tr = TrainingConfig(global_batch=64, seq_len=16)
    search = Search(graph, cl, tr, SearchOptions())
    assert search.costs.grad_sync == "buckets" and not search.costs.flat_sync
    tab = search.table(search.types[0], 1, 1)
    assert tab is not None
    kw: dict[str, Any] = dict(
        dp=2, zero=0, recompute="none", allreduce=(1e-5, 1e-9), reduce_scatter=(2e-5, 2e-10),
        all_gather=(3e-5, 3e-10), p2p=(1e-5, 1e-9), p2p_mult=1, hbm_bandwidth=2e12, factors=StageFactors(),
    )  # fmt: skip
    flat, buckets = stage_parts(tab, flat_sync=True, **kw), stage_parts(tab, buckets=True, **kw)
    n = len(tab.fwd)
    whole = (0, n)  # the whole model as one stage: sync > 0, several layers, a backward to hide under
    assert buckets.tail[whole] < flat.tail[whole]
    grads = tab.ranged("grads")[whole]
    assert buckets.bucketed and buckets.flat_copy and not flat.bucketed
    assert buckets.grads[whole] == min(grads, GRAD_BUCKETS_IN_FLIGHT * GRAD_BUCKET_BYTES) and flat.grads[whole] == grads
    plan = hand_plan(graph, parse_cluster("2xH100-80G"), tr, tp=1, pp=1, dp=2, micro_batch=4)
    s = plan.stages[0]
    assert s.grad_buckets and [c.phase for c in _dp(s.collectives)] == ["backward"] * len(s.grad_buckets)
