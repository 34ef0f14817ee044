"""The search chooses context parallelism and FP8 where they are faster, and the report says why (issue 36).

``search/entry/choices.py`` searches cp 1, each cp degree offered and, where the user allows it, an FP8
plan, and keeps the fastest; ``search/program/realizable.py`` is the switch saying what the emitters build.
The 64k-token cases use the stored Llama-7B graph (Llama-2-7B's shape; its sequence is symbolic, so it
prices 65,536 tokens exactly as ``examples/configs/llama-2-7b-64k.json``'s trace does: the four cp steps
were equal to the last digit when this was written). FP8 cases use small synthetic GPT graphs (cheap);
no test here needs torchao (the search prices FP8, the program is not run).
"""

from __future__ import annotations

import dataclasses
import html
import json
from pathlib import Path

import pytest

from partita.cli import main
from partita.cluster import parse_cluster
from partita.ir import Graph
from partita.passes.annotate import annotate
from partita.plan import Plan
from partita.report.html import why_html
from partita.report.terminal import plan_text
from partita.search.entry.choices import layout_text
from partita.search.entry.evaluate import evaluate_config, tp_style_of
from partita.search.entry.planner import plan_graph
from partita.search.layer.memo import IntraOpMemo
from partita.search.pricing.config import SearchOptions, TrainingConfig
from partita.search.program import realizable
from tests.search.builders import gpt

OPTS = SearchOptions(schedules=("1f1b",), max_micro_batch=2)  # both sides of every comparison search the same
LONG = TrainingConfig(global_batch=16, seq_len=65536)
H100_64 = "64xH100-80G"


@pytest.fixture(scope="module")
def llama() -> Graph:
    from partita.frontends.stored import load_stored
    from partita.frontends.trace import TRACE_BATCH, trace_handle
    from partita.models import resolve_model

    return load_stored("llama-7b", 2048, TRACE_BATCH) or trace_handle(
        resolve_model("llama-7b"), batch=TRACE_BATCH, seq=2048
    )


@pytest.fixture(scope="module")
def memo() -> IntraOpMemo:
    return IntraOpMemo()  # the layer solves of cp 1 shared by the searches below (its keys hold every input)


@pytest.fixture(scope="module")
def long_plans(llama: Graph, memo: IntraOpMemo) -> tuple[Plan, Plan]:
    """At 65,536 tokens on 64 H100: the default search (cp offered: the torch program builds it), and the
    search at cp 1 only."""
    cl = parse_cluster(H100_64)
    flipped = plan_graph(llama, cl, LONG, options=OPTS, memo=memo)
    today = plan_graph(llama, cl, LONG, options=dataclasses.replace(OPTS, cp_degrees=()), memo=memo)
    return flipped, today


@pytest.mark.slow  # a Llama-7B search of its own (module fixture: ~7 CPU s with its workers)
def test_search_picks_cp_for_a_64k_llama_7b_on_64_h100(llama: Graph, long_plans: tuple[Plan, Plan]) -> None:
    """Every cp the switch offers at 65,536 tokens (2, 4, 8: at least 8,192 tokens per rank) is searched;
    the fastest is a cp > 1 plan the torch program builds (tp 1: ``realizable.cp_plan_refusal``); its
    record's cp 1 step is the search without cp, and it is no slower than a hand layout of the searched
    space (dp 16 x cp 4, ZeRO-3, no recompute)."""
    flipped, today = long_plans
    rec = flipped.search["context_parallel"]
    assert rec["degrees"] == [1, 2, 4, 8]
    cp = rec["chosen"]
    assert cp > 1 and {s.cp for s in flipped.stages} == {cp}
    steps = rec["steps"]
    assert steps[str(cp)] == flipped.predicted["step_time_s"] == min(steps.values())
    assert steps["1"] == today.predicted["step_time_s"] > steps[str(cp)]
    assert f"cp {cp}: {steps['1'] / steps[str(cp)]:.2f}x faster than the best cp 1 plan" in rec["why"]
    assert layout_text(today) in rec["why"]  # the cp 1 plan it beat, as the search without cp found it
    wide = plan_text(flipped, width=1000)
    assert "context parallelism" in wide and rec["why"] in wide and f", cp {cp}" in wide  # the stage table's mesh
    assert html.escape(rec["why"]) in why_html(flipped)
    hand = evaluate_config(
        llama,
        parse_cluster(H100_64),
        LONG,
        tp=1,
        pp=1,
        dp=16,
        cp=4,
        micro_batch=1,
        zero_stage=3,
        recompute="none",
        tp_style=tp_style_of(llama),
    )
    assert realizable.cp_plan_refusal(flipped) is None and all(s.tp == 1 for s in flipped.stages)
    if hand.fits:
        assert flipped.predicted["step_time_s"] <= hand.predicted_step_time_s * (1 + 1e-9)
    # the Plan the program would run: devices dp x cp x tp per stage, the whole sequence, a valid round trip
    assert sum(s.dp * s.cp * s.tp for s in flipped.stages) <= 64 and flipped.training["seq_len"] == 65536
    if sum(s.dp * s.cp * s.tp for s in flipped.stages) == 64:  # every device used: the two MFUs are one
        assert flipped.predicted["mfu_cluster"] == pytest.approx(flipped.predicted["mfu"])
    assert all("dp counts dp x cp" in a["summary"] for a in flipped.search["alternatives"])
    assert Plan.from_json(flipped.to_json()).to_json() == flipped.to_json()  # validated on reading


def test_cp_is_offered_only_where_the_program_builds_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """The torch program builds cp for Llama models (backends/torch/context_parallel.ARCHS) at tp 1, pipelined
    on torch.distributed.pipelining only; the search offers nothing else (design rule 1)."""
    from partita.backends.torch import context_parallel as cp_runtime

    assert realizable.CP_ARCHS == cp_runtime.ARCHS
    assert realizable.cp_degrees("torch", 65536, "LlamaForCausalLM") == (2, 4, 8)
    assert realizable.cp_degrees("torch", 65536, "GPT2LMHeadModel") == ()
    assert "not GPT2LMHeadModel" in (realizable.cp_refusal("torch", 65536, "GPT2LMHeadModel") or "")
    assert realizable.cp_degrees("jax", 65536) == ()
    assert "jax program does not split" in (realizable.cp_refusal("jax", 65536) or "")
    monkeypatch.setitem(realizable.CP_EMITTED, "torch", False)
    assert realizable.cp_degrees("torch", 65536) == ()


def test_the_switch_offers_cp_only_at_long_sequences() -> None:
    assert realizable.cp_degrees("torch", 131072) == (2, 4, 8, 16)
    assert realizable.cp_degrees("torch", 65536) == (2, 4, 8)
    assert realizable.cp_degrees("torch", 8192) == () == realizable.cp_degrees("torch", 2048)
    assert realizable.cp_degrees("jax", 65536) == ()
    assert "fewer than 16,384" in (realizable.cp_refusal("torch", 8192) or "")


@pytest.mark.slow  # a Llama-7B search of its own (module fixture: ~7 CPU s with its workers)
def test_search_keeps_cp_1_at_short_sequences(llama: Graph, memo: IntraOpMemo) -> None:
    """cp searched at 4,096 tokens (asked for: the switch would not offer it there), batch 64: every cp > 1
    plan is slower, so cp 1 is kept and the record says by how much."""
    tr = TrainingConfig(global_batch=64, seq_len=4096)
    plan = plan_graph(
        llama, parse_cluster(H100_64), tr, options=dataclasses.replace(OPTS, cp_degrees=(2, 4)), memo=memo
    )
    rec = plan.search["context_parallel"]
    assert rec["chosen"] == 1 and {s.cp for s in plan.stages} == {1}
    assert rec["steps"]["1"] == plan.predicted["step_time_s"] < min(rec["steps"]["2"], rec["steps"]["4"])
    assert rec["why"].startswith("cp 1: the best cp 2 plan") and "x slower" in rec["why"]


# ---- FP8 -------------------------------------------------------------------------------------------
def _gpt(hidden: int, heads: int, framework: str = "torch") -> Graph:
    g = annotate(gpt(4, hidden, heads))
    g.meta["framework"] = framework
    return g


FP8 = TrainingConfig(global_batch=64, seq_len=2048, fp8="tensorwise")  # fp8 allowed: the search may choose it


def test_fp8_is_chosen_on_h100_where_faster() -> None:
    """hidden 4096: the FP8 GEMMs' gain beats the casts; the plan trains in fp8 (the program's torchao
    conversion reads plan.training) on tp 1 stages only, and its bf16 step is the search without fp8."""
    g, cl = _gpt(4096, 32), parse_cluster("8xH100-80G")
    plan = plan_graph(g, cl, FP8, options=OPTS)
    rec = plan.search["fp8"]
    assert rec["chosen"] and plan.training["fp8"] == "tensorwise" and {s.tp for s in plan.stages} == {1}
    bf16 = plan_graph(g, cl, dataclasses.replace(FP8, fp8=None), options=OPTS)
    assert "fp8" not in bf16.search and "fp8" not in bf16.training  # not asked: never offered
    assert rec["steps"] == {"bf16": bf16.predicted["step_time_s"], "fp8": plan.predicted["step_time_s"]}
    assert rec["steps"]["fp8"] < rec["steps"]["bf16"]
    assert f"{rec['steps']['bf16'] / rec['steps']['fp8']:.2f}x faster than the best bf16 plan" in rec["why"]
    wide = plan_text(plan, width=1000)
    assert "fp8" in wide and rec["why"] in wide
    assert html.escape(rec["why"]) in why_html(plan)


def test_fp8_is_not_chosen_where_slower() -> None:
    """hidden 1024: the casts cost more than the FP8 peak saves; the plan stays bf16 and says by how much."""
    plan = plan_graph(_gpt(1024, 16), parse_cluster("8xH100-80G"), FP8, options=OPTS)
    rec = plan.search["fp8"]
    assert not rec["chosen"] and "fp8" not in plan.training
    assert rec["steps"]["fp8"] > rec["steps"]["bf16"] == plan.predicted["step_time_s"]
    assert rec["why"].startswith("fp8 not chosen: the best fp8 plan") and "x slower than bf16's" in rec["why"]


def test_mixed_cluster_keeps_a100_in_bf16() -> None:
    """A100 has no FP8 tensor cores: never an FP8 stage. The fp8 plan is searched on every type, each stage in
    its own precision (Stage.fp8): 2 H100 + 2 A100 and 8 blocks of hidden 4096 need both types' memory, so the
    fp8 plan runs the H100 stage in fp8 and the A100 stage in bf16 (before, the A100s were left out of it)."""
    g = annotate(gpt(8, 4096, 32))
    g.meta["framework"] = "torch"
    plan = plan_graph(g, parse_cluster("2xA100-80G+2xH100-80G"), FP8, options=OPTS)
    rec = plan.search["fp8"]
    assert rec["chosen"] and plan.training["fp8"] == "tensorwise"
    assert {(s.device_type, s.fp8) for s in plan.stages} == {("H100-80G", "tensorwise"), ("A100-80G", None)}
    assert {s.tp for s in plan.stages if s.fp8} == {1}
    assert "no FP8 tensor cores" in rec["bf16_types"]["A100-80G"]
    assert rec["types"]["A100-80G"].startswith("bf16 on 1 stage(s): no FP8 tensor cores")
    assert rec["types"]["H100-80G"].startswith("fp8 on 1 stage(s)")
    text = plan_text(plan, width=1000)  # the report: each type's precision and why
    assert "A100-80G: bf16 on 1 stage(s): no FP8 tensor cores" in text and "H100-80G: fp8 on 1 stage(s)" in text
    again = Plan.from_json(plan.to_json())
    assert [s.fp8 for s in again.stages] == [s.fp8 for s in plan.stages]


@pytest.mark.parametrize(
    ("cluster", "framework", "says"),
    [
        ("8xA100-80G", "torch", "fp8 not offered: A100-80G has no FP8 tensor cores"),
        ("8xH100-80G", "jax", "fp8 not offered: the jax program has no FP8 training"),
    ],
)
def test_fp8_not_offered_where_nothing_runs_it(cluster: str, framework: str, says: str) -> None:
    plan = plan_graph(_gpt(1024, 16, framework), parse_cluster(cluster), FP8, options=OPTS)
    assert plan.search["fp8"]["why"] == says and "fp8" not in plan.training


@pytest.mark.slow  # a compile through the CLI (imports torch, emits the program)
def test_compile_precision_fp8_without_a_layout_lets_the_search_choose(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Refused before issue 36's search; now the plan says whether fp8 was chosen and why."""
    monkeypatch.setenv("PARTITA_CACHE_DIR", str(tmp_path / "cache"))
    out = tmp_path / "out"
    args = ["compile", "mlp", "--cluster", "2xCPU", "--global-batch", "8", "--seq", "16", "--precision", "fp8"]
    assert main([*args, "--out", str(out), "--json"]) == 0
    rec = json.loads((out / "plan.json").read_text())["search"]["fp8"]
    assert rec["why"].startswith(("fp8 (tensorwise):", "fp8 not chosen:"))
