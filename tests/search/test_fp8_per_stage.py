"""FP8 per stage (issue 36 item 2, "mixed clusters keep each type's best precision per stage"): the Plan
says per stage whether its linears train in FP8 (``Stage.fp8``), each stage is priced in its own
precision (``stage_cost.SolverCosts.cost_model``: FP8 only on device types with FP8 tensor cores), and the
program converts exactly the stages whose Stage says fp8. No torchao here: the program's text is checked,
``tests/runtime/test_fp8_multiprocess.py`` runs fp8 programs."""

from __future__ import annotations

import dataclasses
import json

import pytest

from partita.backends.torch.emit import emit_torch
from partita.cli import main
from partita.cluster import DEVICE_PRESETS, parse_cluster, parse_shorthand
from partita.errors import PlanError
from partita.ir import Prim
from partita.passes.annotate import annotate
from partita.plan import Plan, Stage
from partita.search.pipeline.stage_cost import SolverCosts
from partita.search.pricing import fp8
from partita.search.pricing.config import TrainingConfig
from partita.search.pricing.cost_model import CostModel
from tests.search.builders import gpt
from tests.test_plan import make_plan

FP8 = TrainingConfig(global_batch=8, seq_len=2048, fp8="tensorwise")


def test_plan_round_trips_stage_precision_and_older_plans_stay_byte_identical() -> None:
    plain = make_plan()
    assert '"fp8"' not in plain.to_json()  # no fp8 stage: nothing written (older plans read and write as before)
    mixed = dataclasses.replace(
        plain,
        training={**plain.training, "dtype": "bf16", "fp8": "rowwise"},
        stages=(dataclasses.replace(plain.stages[0], fp8="rowwise"), plain.stages[1]),
    )
    text = mixed.to_json()
    d = json.loads(text)
    assert d["stages"][0]["fp8"] == "rowwise" and "fp8" not in d["stages"][1]
    back = Plan.from_json(text)
    assert [s.fp8 for s in back.stages] == ["rowwise", None] and back.to_json() == text
    # a plan from before per-stage precision: training.fp8 and no stage saying it ran every stage in fp8
    for st in d["stages"]:
        st.pop("fp8", None)
    assert [s.fp8 for s in Plan.from_dict(d).stages] == ["rowwise", "rowwise"]
    # a stage's recipe is training.fp8's: anything else is an edited file
    d["stages"][1]["fp8"] = "tensorwise"
    with pytest.raises(PlanError, match="stage 1 trains in fp8 .'tensorwise'. but training.fp8 is 'rowwise'"):
        Plan.from_dict(d)
    d["stages"][1]["fp8"] = 8
    with pytest.raises(PlanError, match=r"stages\[1\]\.fp8"):
        Plan.from_dict(d)


def _gemm(cm: CostModel, tokens: int = 8192, k: int = 16384, n: int = 16384) -> tuple[float, float, float]:
    flops = 2.0 * tokens * k * n
    nbytes = 4.0 * (tokens * k + k * n + tokens * n)  # inputs + output at the traced width, as intra_op counts
    return cm.compute_time(Prim.MATMUL, flops, nbytes, "bf16"), flops, nbytes


def test_each_stage_is_priced_in_its_device_types_precision() -> None:
    """H100 + A100 with fp8 allowed: a stage on the H100s runs its GEMMs at the FP8 peak with their casts,
    one on the A100s at its bf16 peak, as without fp8 (before, every type was priced fp8: the A100's FP8
    peak of 0 gave its GEMMs no finite time, so the search left the A100s out of the fp8 plan)."""
    g = annotate(gpt(2, 4096, 32))
    g.meta["framework"] = "torch"
    cl = parse_cluster("2xH100-80G+2xA100-80G")
    f8, bf = SolverCosts(g, cl, FP8), SolverCosts(g, cl, dataclasses.replace(FP8, fp8=None))
    h100, a100 = DEVICE_PRESETS["H100-80G"], DEVICE_PRESETS["A100-80G"]
    assert f8.cost_model(h100).fp8 == "tensorwise" and f8.cost_model(a100).fp8 is None
    cm = f8.cost_model(h100)
    t, flops, nbytes = _gemm(cm)
    eff = cm.efficiency
    assert t == fp8.gemm_time(flops, nbytes, h100, eff.matmul_efficiency(flops), eff.memory, eff.kernel_overhead_s)
    assert t < _gemm(bf.cost_model(h100))[0]  # a large GEMM: the FP8 peak wins over its casts
    # a block of each stage (layer 1), per micro-batch: faster on the H100 in fp8, the A100's as bf16's
    blk_h = [c.layer(1, h100, 1, 2)[0] for c in (f8, bf)]
    blk_a = [c.layer(1, a100, 1, 2)[0] for c in (f8, bf)]
    assert blk_h[0].forward_s + blk_h[0].backward_s < blk_h[1].forward_s + blk_h[1].backward_s
    assert (blk_a[0].forward_s, blk_a[0].backward_s) == (blk_a[1].forward_s, blk_a[1].backward_s)


def _pp2_plan(fp8_stages: tuple[str | None, str | None]) -> Plan:
    """A tiny Llama in two pipeline stages on 2 CPU ranks, bf16 with training.fp8 allowed, each stage's
    precision as given (CPU ranks run torchao's emulation, so either may say fp8 here)."""
    cl = parse_shorthand("2xCPU")
    layers = [["embed", "model.layers.0"], ["model.layers.1", "head"]]
    stages = tuple(
        Stage(index=i, layers=tuple(ls), device_type="CPU", ranks=(i,), dp=1, tp=1, fp8=f)
        for i, (ls, f) in enumerate(zip(layers, fp8_stages))
    )
    return Plan(
        model={"name": "llama-tiny", "framework": "torch", "layers": [x for ls in layers for x in ls]},
        cluster={"name": cl.name, "fingerprint": cl.fingerprint(), "spec": cl.to_dict()},
        training={"global_batch": 4, "seq_len": 16, "dtype": "bf16", "optimizer": "adamw", "fp8": "tensorwise"},
        stages=stages,
        schedule="1f1b",
        micro_batch_size=2,
        num_micro_batches=2,
        predicted={"step_time_s": 0.05},
    )


def _setup(src: str, i: int) -> str:
    return src.split(f"def setup_stage_{i}(")[1].split("\ndef ")[0]


def test_program_converts_exactly_the_stages_whose_stage_says_fp8() -> None:
    src = emit_torch(_pp2_plan(("tensorwise", None)), "llama-tiny")
    assert "convert_to_float8_training(" in _setup(src, 0)
    assert "from_recipe_name('tensorwise')" in _setup(src, 0)
    assert "convert_to_float8_training" not in _setup(src, 1)
    assert "Stage.fp8 unset: this stage trains in bf16" in _setup(src, 1)
    assert "from partita.backends.torch import fp8\n" in src
    bf16 = emit_torch(_pp2_plan((None, None)), "llama-tiny")  # fp8 allowed, no stage on an FP8 type
    assert "convert_to_float8_training" not in bf16 and "from partita.backends.torch import fp8\n" not in bf16


def test_hand_layout_on_a_mixed_cluster_prices_fp8_on_its_fp8_type(capsys: pytest.CaptureFixture[str]) -> None:
    """A hand layout runs every stage on the cluster's first device type: H100 first, the layout trains in
    fp8 (the A100s beside it no longer refuse the request); A100 first, the request is refused (exit 2)."""
    args = ["evaluate", "llama-7b", "--tp", "1", "--dp", "8", "--micro-batch", "1", "--global-batch", "8"]
    args += ["--seq", "2048", "--precision", "fp8", "--json"]
    assert main([*args, "--cluster", "8xH100-80G+8xA100-80G"]) == 0
    out = capsys.readouterr().out
    assert "H100-80G 989 -> 1979 TFLOP/s" in out and "A100-80G has no FP8 tensor cores" in out
    assert main([*args, "--cluster", "8xA100-80G+8xH100-80G"]) == 2
    err = capsys.readouterr().err
    assert "A100-80G has no FP8 tensor cores" in err and "Traceback" not in err


def test_fp8_search_keeps_fp8_types_at_tp_1_and_never_mixes_them_with_bf16_types_in_a_stage() -> None:
    from partita.search.program import realizable

    h100, a100 = DEVICE_PRESETS["H100-80G"], DEVICE_PRESETS["A100-80G"]
    bf16 = dataclasses.replace(FP8, fp8=None)
    assert realizable.fp8_max_tp(FP8, h100, 8) == realizable.FP8_MAX_TP == 1
    assert realizable.fp8_max_tp(FP8, a100, 8) == 8 and realizable.fp8_max_tp(bf16, h100, 8) == 8
    assert not realizable.fp8_mix_ok(FP8, [h100, a100])  # one stage converts all its replicas or none
    assert realizable.fp8_mix_ok(bf16, [h100, a100]) and realizable.fp8_mix_ok(FP8, [h100, DEVICE_PRESETS["H200"]])
