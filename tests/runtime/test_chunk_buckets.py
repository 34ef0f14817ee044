"""Issue 32 item 1: gradient buckets for interleaved 1F1B's model chunks, and the phase check of FSDP2's
reduce-scatter.

What these tests prove (each fails on the code before them):

* the plan: an interleaved plan of dp 2 at ZeRO-0 lists each chunk's own buckets (records in phase
  ``backward``); the program's one module per rank group lists them the last chunk's first; ZB-V keeps
  the flat sync (``plan.flat_sync_chunks``) and refuses buckets;
* the rehearsal: each rank group issues every bucket of its chunks inside the backward, as the plan says;
* torchrun: the bucketed interleaved program's losses and gradients equal the single-device run
  (``test_schedules_runtime``'s checks: step 1 within 1e-5 of each tensor's largest entry, step 2 rtol 1e-4,
  docs/parity.md), and its collectives equal the plan's records and the first-principles counts;
* the price: the interleaved plan's tail is the bucketed sync's (the same as 1F1B's for the same rank
  groups), no longer the flat sync's;
* FSDP2's reduce-scatter: a program that reduce-scatters after the schedule fails a plan that says
  ``backward``; a pipelined ZeRO-1 stage (reduced after the position's last action) is recorded so.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import pytest

from partita.backends.torch import chunks as vchunks
from partita.backends.torch import rehearse
from partita.errors import PlanError
from partita.plan import Plan
from tests.runtime import test_schedules_runtime as srt
from tests.runtime.plans import _graph, layout

os.environ.setdefault("OMP_NUM_THREADS", "1")
MODEL = "gpt2-tiny"


def _program(tmp: Path, plan: Plan, model: str = MODEL) -> Any:
    from partita.backends.torch import launch as torch_launch
    from partita.backends.torch.emit import emit_torch

    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "plan.json").write_text(plan.to_json())
    (tmp / "program_torch.py").write_text(emit_torch(plan, model))
    return torch_launch.load_program(tmp)


def _bucketed() -> Plan:
    return srt.schedule_plan(MODEL, "v2_dp_buckets", "interleaved_1f1b")


def test_each_interleaved_chunk_has_its_own_buckets() -> None:
    plan = _bucketed()
    assert plan.chunked and all(s.grad_buckets for s in plan.stages)
    for s in plan.stages:
        dp = [c for c in s.collectives if c.axis == "dp"]
        assert [c.phase for c in dp] == ["backward"] * len(s.grad_buckets)
    for group, merged in zip(plan.positions(), vchunks.physical_plan(plan).stages):
        assert merged.grad_buckets == tuple(b for s in reversed(group) for b in s.grad_buckets)
    zbv = srt.schedule_plan(MODEL, "v2_dp_buckets", "zbv")  # ZB-V: the flat sync after the schedule
    assert not any(s.grad_buckets for s in zbv.stages)
    d = zbv.to_dict()
    d["stages"][0]["grad_buckets"] = [list(b) for b in plan.stages[0].grad_buckets]
    with pytest.raises(PlanError, match="ZB-V"):
        Plan.from_dict(d)


def test_interleaved_rank_groups_sync_their_chunks_inside_the_backward(tmp_path: Path) -> None:
    plan = _bucketed()
    program = _program(tmp_path, plan)
    for s in vchunks.physical_plan(plan).stages:
        got = rehearse.rehearse_rank(program, s.ranks[0])
        assert len(s.grad_buckets) > 2 and got.in_backward == {"all_reduce@dp": len(s.grad_buckets)}
        assert [m for m in rehearse.compare_stage(s, [got])["mismatches"] if "@dp" in m] == []


@pytest.mark.multiprocess
def test_interleaved_buckets_match_single_device(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # every chunk bucketed (several buckets each: BUCKET_TEST_BYTES), so the counted all-reduces per rank group
    # (_first_principles: one per bucket) and the gradients both follow the buckets
    assert all(len(s.grad_buckets) > 1 for s in _bucketed().stages)
    monkeypatch.setitem(srt.JOBS, 4, [(MODEL, "v2_dp_buckets", "interleaved_1f1b")])
    srt.test_schedules_match_single_device(tmp_path, 4)


def test_interleaved_tail_is_the_bucketed_sync() -> None:
    from partita.cluster import parse_cluster
    from partita.search.entry.hand_plan import hand_plan
    from partita.search.pricing.config import TrainingConfig

    tr = TrainingConfig(global_batch=32, seq_len=16)
    kw: dict[str, Any] = dict(tp=1, pp=2, dp=2, micro_batch=2)
    cl = parse_cluster("4xH100-80G")  # H100: the shipped profile overlaps (A100's fits comm_overlap = 0)
    one = hand_plan(_graph(MODEL), cl, tr, schedule="1f1b", **kw)
    inter = hand_plan(_graph(MODEL), cl, tr, schedule="interleaved_1f1b", num_virtual=2, **kw)
    zbv = hand_plan(_graph(MODEL), cl, tr, schedule="zbv", **kw)
    assert inter.chunked and all(s.grad_buckets for s in inter.stages) and not any(s.grad_buckets for s in zbv.stages)
    # the same rank groups and ranges: the interleaved tail is 1F1B's bucketed one (it was the flat sync's)
    assert inter.predicted["tail_s"] == pytest.approx(one.predicted["tail_s"], rel=1e-9)
    flat = [c for s in zbv.stages for c in s.collectives if c.kind == "all_reduce" and c.axis == "dp"]
    assert flat and all(c.phase == "optimizer" for c in flat)


# ---- FSDP2's reduce-scatter: where it is issued is compared with the plan -----------------------------
def test_reduce_scatter_after_the_schedule_fails_a_plan_that_says_backward(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from partita.frontends import torch_shim

    plan = layout(MODEL, "zero1")
    s = plan.stages[0]
    rs = [c for c in s.collectives if c.kind == "reduce_scatter"]
    assert rs and all(c.phase == "backward" for c in rs)
    program = _program(tmp_path / "a", plan)
    got = rehearse.rehearse_rank(program, 0)
    n = got.collectives["reduce_scatter@dp"]["count"]
    assert got.in_backward.get("reduce_scatter@dp") == n
    assert [m for m in rehearse.compare_stage(s, [got])["mismatches"] if "@dp" in m] == []
    # the same program deferring FSDP2's reduce-scatter to after the schedule (as a pipelined ZeRO-1 runner does:
    # no sync in any backward, then FSDP2's post-backward run by hand)
    from partita.backends.torch import schedule as torch_schedule
    from partita.backends.torch import train as torch_train

    sync, step = torch_schedule.zero_micro_batch, torch_train.forward_backward
    monkeypatch.setattr(torch_schedule, "zero_micro_batch", lambda fsdp, zero, last: sync(fsdp, zero, False))

    def deferred(runner: Any, rt: Any, me: Any, xs: list, ys: list, tied: tuple) -> list:
        local = step(runner, rt, me, xs, ys, tied)
        torch_shim.fsdp_reduce_grads(rt.fsdp_modules[-1])
        return local

    monkeypatch.setattr(torch_train, "forward_backward", deferred)
    late = rehearse.rehearse_rank(_program(tmp_path / "b", plan), 0)
    assert late.collectives["reduce_scatter@dp"]["count"] == n and late.in_backward.get("reduce_scatter@dp", 0) == 0
    problems = [m for m in rehearse.compare_stage(s, [late])["mismatches"] if "@dp" in m]
    assert len(problems) == 1 and problems[0].startswith("reduce_scatter@dp: 0 issued inside the backward"), problems


def test_pipelined_zero1_reduces_after_the_schedule_as_recorded(tmp_path: Path) -> None:
    # llama-tiny: no weight tied across rank groups (GPT-2's tied sync trips on DTensor caches a previous
    # in-process rehearsal left)
    plan = srt.schedule_plan("llama-tiny", "v2_z1", "interleaved_1f1b")
    program = _program(tmp_path, plan, "llama-tiny")
    for s in vchunks.physical_plan(plan).stages:
        rs = [c for c in s.collectives if c.kind == "reduce_scatter"]
        assert rs and all(c.phase == "optimizer" for c in rs)  # the plan said backward: the rehearsal disagreed
        got = rehearse.rehearse_rank(program, s.ranks[0])
        assert got.collectives["reduce_scatter@dp"]["count"] == sum(c.count for c in rs)
        assert "reduce_scatter@dp" not in got.in_backward
        assert [m for m in rehearse.compare_stage(s, [got])["mismatches"] if "@dp" in m] == []


def test_a_plan_claiming_backward_for_a_pipelined_zero1_fails(tmp_path: Path) -> None:
    plan = srt.schedule_plan("llama-tiny", "v2_z1", "interleaved_1f1b")
    s = vchunks.physical_plan(plan).stages[0]
    got = rehearse.rehearse_rank(_program(tmp_path, plan, "llama-tiny"), s.ranks[0])
    claims = dataclasses.replace(
        s,
        collectives=tuple(
            dataclasses.replace(c, phase="backward") if c.kind == "reduce_scatter" else c for c in s.collectives
        ),
    )
    assert any(m.startswith("reduce_scatter@dp: 0 issued") for m in rehearse.compare_stage(claims, [got])["mismatches"])


def test_a_p2p_1f1b_zero1_stage_reduces_inside_its_last_backward_as_recorded(tmp_path: Path) -> None:
    """``P2PPipeline`` running 1F1B on one chunk per rank (stages of different shapes: here the first stage's
    replicas take 3 and 1 samples) syncs ZeRO-1 in its last backward, unlike ``torch.distributed.pipelining``
    and the split / chunked runners (``records.zero1_reduces_after_schedule``). Recorded ``optimizer`` for every
    pipelined ZeRO-1 stage, the rehearsal of gpt3-13b-search (4 stages of different shapes) disagreed."""
    from partita.search.program import records
    from tests.runtime.plans import make_plan

    a, b = srt._halves("llama-tiny")
    stages = [
        dict(layers=a, ranks=[0, 1], dp=2, tp=1, zero_stage=1, batch_shares=(3, 1)),
        dict(layers=b, ranks=[2, 3], dp=2, tp=1, zero_stage=1),
    ]
    plan = make_plan("llama-tiny", stages, schedule="1f1b", micro_batch_size=2, num_micro_batches=4, global_batch=16)
    plan = Plan.from_json(plan.to_json(), "llama-tiny")
    assert records.runner_kind(plan) == "p2p" and not records.zero1_reduces_after_schedule(plan)
    program = _program(tmp_path, plan, "llama-tiny")
    for s in plan.stages:
        rs = [c for c in s.collectives if c.kind == "reduce_scatter"]
        assert rs and all(c.phase == "backward" for c in rs)
        got = rehearse.rehearse_rank(program, s.ranks[0])
        assert got.in_backward.get("reduce_scatter@dp") == sum(c.count for c in rs)
        assert [m for m in rehearse.compare_stage(s, [got])["mismatches"] if "@dp" in m] == []
    equal = srt.schedule_plan("llama-tiny", "pp_zero1", "1f1b")  # torch.distributed.pipelining: after the schedule
    assert records.runner_kind(equal) == "torch_pipeline" and records.zero1_reduces_after_schedule(equal)
