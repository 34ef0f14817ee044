"""Context parallelism in the Plan (issue 36): a cp degree per stage (data, plan.json, validated on reading),
its collective records (``search/program/context_parallel.py``), and the refusals while no emitter runs it.

Records are checked against closed forms of the builder's GPT (hidden 1024, 16 heads, bf16): per block
and micro-batch, K and V of the whole sequence (``b x S x hidden / tp`` elements each) all-gathered over
cp forward and their gradients reduce-scattered backward; the gradient all-reduce of every parameter
(f32) over the ``dp * cp`` ranks that replicate it; pipeline transfers of each rank's ``S / cp`` tokens.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from partita.cli import main
from partita.errors import ConfigError, PlanError
from partita.ir import Role, dim_size
from partita.plan import Plan, Stage
from partita.search.pricing import context_parallel as cpx
from partita.search.program import context_parallel as cpr
from partita.search.program import records
from tests.search.builders import gpt

HIDDEN, HEADS, SEQ, LAYERS = 1024, 16, 4096, 2


@pytest.fixture(scope="module")
def g():  # noqa: ANN201
    return gpt(LAYERS, HIDDEN, HEADS)


def _plan(g, *, dp: int = 2, cp: int = 2, tp: int = 1, pp: int = 1, mb: int = 2, recompute: str = "none") -> Plan:  # noqa: ANN001
    names = [lay.name for lay in g.layers]
    per = -(-len(names) // pp)
    n = dp * cp * tp
    stages = tuple(
        Stage(
            k,
            tuple(names[k * per : (k + 1) * per]),
            "H100-80G",
            tuple(range(k * n, (k + 1) * n)),
            dp=dp,
            tp=tp,
            cp=cp,
            recompute=recompute,
        )  # fmt: skip
        for k in range(pp)
    )
    return Plan(
        model={"name": "gpt", "layers": names},
        cluster={"name": "c"},
        training={"global_batch": 4 * mb * dp, "seq_len": SEQ, "dtype": "bf16"},
        stages=stages,
        schedule="1f1b",
        micro_batch_size=mb,
        num_micro_batches=4,
    )


def _params_numel(g) -> int:  # noqa: ANN001
    return sum(math.prod(dim_size(d) for d in t.shape) for t in g.tensors.values() if t.role is Role.PARAMETER)


def test_cp_round_trips_and_places_ranks_dp_cp_tp(g) -> None:  # noqa: ANN001
    p = _plan(g, dp=2, cp=2, tp=2)
    text = p.to_json()
    back = Plan.from_json(text)
    assert back.to_json() == text and back.stages[0].cp == 2 and back.world_size == 8
    s = back.stages[0]
    assert s.num_devices == 8
    # ranks (dp, cp, tp), tp fastest: rank 6 = (i=1, c=1, j=0)
    assert [(s.coords(r), s.cp_index(r)) for r in (0, 1, 2, 5, 6)] == [
        ((0, 0), 0),
        ((0, 1), 0),
        ((0, 0), 1),
        ((1, 1), 0),
        ((1, 0), 1),
    ]


def test_cp_1_is_not_written(g) -> None:  # noqa: ANN001
    """Plans without context parallelism are byte-identical to before the field (golden files unchanged)."""
    d = json.loads(_plan(g, cp=1).to_json())
    assert all("cp" not in s for s in d["stages"]) and Plan.from_dict(d).stages[0].cp == 1


@pytest.mark.parametrize(
    "pp, mutate, match",
    [
        (1, lambda d: d["stages"][0].update(ranks=[0, 1]), r"dp=2, cp=2, tp=1 but 2 ranks"),
        (1, lambda d: d["stages"][0].update(cp=0), "cp=0"),
        (1, lambda d: d["stages"][0].update(cp=3, ranks=list(range(6))), "does not divide training.seq_len=4096"),
        (1, lambda d: d["stages"][0].update(cp="two"), r"stages\[0\].cp"),
        (2, lambda d: d["stages"][1].update(cp=1, ranks=[4, 5]), "other stages have cp=.1."),
    ],
)
def test_malformed_cp_is_refused_on_reading(g, pp: int, mutate, match: str) -> None:  # noqa: ANN001
    d = json.loads(_plan(g, pp=pp).to_json())
    mutate(d)
    with pytest.raises(PlanError, match=match):
        Plan.from_dict(d)


@pytest.mark.parametrize("dp, cp, tp, recompute", [(2, 2, 1, "none"), (1, 4, 2, "none"), (2, 2, 1, "full")])
def test_records_gather_kv_over_cp_and_sync_over_dp_cp(g, dp: int, cp: int, tp: int, recompute: str) -> None:  # noqa: ANN001
    mb, m = 2, 4
    plan = cpr.complete(_plan(g, dp=dp, cp=cp, tp=tp, mb=mb, recompute=recompute), g)
    got = records.summary(plan.stages[0].collectives)
    kv = mb * SEQ * HIDDEN // tp * 2  # the whole sequence's K (or V) of this tp rank's heads, bf16
    gathers = 2 * LAYERS * m * (2 if recompute == "full" else 1)  # K and V per block and micro-batch
    assert got["all_gather@cp"] == {"count": gathers, "bytes": gathers * kv}
    assert got["reduce_scatter@cp"] == {"count": 2 * LAYERS * m, "bytes": 2 * LAYERS * m * kv}
    # every parameter replicated over dp x cp: one f32 all-reduce of all of them (tp = 1 shards none here)
    assert got["all_reduce@dp_cp"]["count"] == 1
    if tp == 1:
        assert got["all_reduce@dp_cp"]["bytes"] == 4 * _params_numel(g)
    assert not any(k.endswith("@dp") for k in got)


def test_pipeline_transfers_carry_each_ranks_slice(g) -> None:  # noqa: ANN001
    mb, cp = 2, 4
    plan = cpr.complete(_plan(g, dp=1, cp=cp, pp=2, mb=mb), g)
    got = records.summary(plan.stages[0].collectives)
    per_message = mb * (SEQ // cp) * HIDDEN * 2  # the residual stream of S / cp tokens, bf16
    assert got["p2p@pp"] == {"count": 2 * 4, "bytes": 2 * 4 * per_message}


def test_selective_recompute_with_cp_is_refused(g) -> None:  # noqa: ANN001
    with pytest.raises(ConfigError, match="selective recompute"):
        cpr.complete(_plan(g, recompute="selective"), g)


def test_without_cp_the_records_are_records_complete(g) -> None:  # noqa: ANN001
    plan = _plan(g, cp=1)
    assert cpr.complete(plan, g) == records.complete(plan, g)


@pytest.mark.parametrize("backend", ["torch", "jax"])
def test_emitters_refuse_a_cp_plan_they_do_not_build(g, backend: str) -> None:  # noqa: ANN001
    """JAX builds no cp; the PyTorch program builds it for Llama only (``context_parallel.ARCHS``): a GPT-2 plan
    is refused by both, each with one paragraph."""
    if backend == "torch":
        from partita.backends.torch.emit import emit_torch as emit

        match = "cp=2. is built for LlamaForCausalLM .* gpt2-tiny is a GPT2LMHeadModel"
    else:
        from partita.backends.jax.emit import emit_jax as emit

        match = "cp=2 ranks .context parallelism., which the JAX emitter does not build"
    with pytest.raises(PlanError, match=match):
        emit(_plan(g), "gpt2-tiny")


@pytest.mark.parametrize(
    ("model", "extra", "said"),
    [
        ("gpt2-tiny", ("--dp", "2"), "is built for LlamaForCausalLM"),
        ("llama-tiny", ("--pp", "2", "--zero", "2"), "in a pipeline that runs on explicit send/recv"),
        ("llama-tiny", ("--tp", "2"), "with tensor parallelism (tp=2) is not built by the PyTorch program"),
    ],
)
def test_compile_cp_refuses_what_the_program_does_not_build(
    tmp_path: Path, capsys: pytest.CaptureFixture, model: str, extra: tuple[str, ...], said: str
) -> None:
    """``compile --cp 2`` runs for dp x cp ranks of a Llama (``tests/runtime/
    test_context_parallel_program.py``, with pp on torch.distributed.pipelining too); other models, cp with tp
    and cp in a send/recv pipeline are refused before tracing."""
    out = tmp_path / "out"
    rc = main(["compile", model, "--cluster", "4xCPU", *extra, "--cp", "2", "--out", str(out)])
    err = capsys.readouterr().err
    assert rc == 2 and said in " ".join(err.split()) and "Traceback" not in err
    assert not out.exists() or not any(out.iterdir())


def test_hand_plan_lays_out_cp_as_evaluate_prices_it() -> None:
    """``hand_plan(cp=)`` (the Plan ``compile --cp`` will write): stages of dp replicas with cp, ranks
    ``dp * cp * tp`` per stage, the whole sequence in ``training``, the step ``evaluate --cp`` prices, and
    the records of the closed forms: K/V of the whole sequence gathered over cp per block and micro-batch,
    the gradient all-reduce over dp x cp, pipeline transfers of S / cp tokens. The MFU counts the whole
    sequence's FLOPs (every query meets every key): MFU x step x devices is the cp = 1 plan's."""
    from partita.cluster import parse_cluster
    from partita.passes.annotate import annotate
    from partita.search.entry.evaluate import evaluate_config
    from partita.search.entry.hand_plan import hand_plan
    from partita.search.pricing.config import TrainingConfig

    cl = parse_cluster("64xH100-80G")
    tr = TrainingConfig(global_batch=8, seq_len=SEQ, dtype="bf16")
    dp, cp, tp, mb = 2, 2, 2, 1
    m = tr.global_batch // (dp * mb)
    kw = dict(tp=tp, dp=dp, micro_batch=mb, cp=cp)
    g = annotate(gpt(LAYERS, HIDDEN, HEADS))  # with FLOPs (the module's fixture has none)
    for pp in (1, 2):
        plan = Plan.from_json(hand_plan(g, cl, tr, pp=pp, **kw).to_json())
        ev = evaluate_config(g, cl, tr, pp=pp, tp_style="torch", **kw)
        assert plan.predicted["step_time_s"] == pytest.approx(ev.predicted_step_time_s, rel=1e-9)
        one = hand_plan(g, cl, tr, pp=pp, tp=tp, dp=dp, micro_batch=mb).predicted
        assert plan.predicted["mfu"] > 0
        assert plan.predicted["mfu"] * plan.predicted["step_time_s"] * cp == pytest.approx(
            one["mfu"] * one["step_time_s"], rel=1e-6
        )
        # against the whole cluster too (was left at S / cp's FLOPs: 64 devices, dp x cp x tp x pp of them used)
        used = dp * cp * tp * pp
        assert plan.predicted["mfu_cluster"] == pytest.approx(plan.predicted["mfu"] * used / 64, rel=1e-6)
        assert (plan.training["seq_len"], plan.num_micro_batches, plan.world_size) == (SEQ, m, dp * cp * tp * pp)
        assert [(s.dp, s.cp, s.tp) for s in plan.stages] == [(dp, cp, tp)] * pp
        assert plan.search["hand_layout"]["cp"] == cp
        got = records.summary([c for s in plan.stages for c in s.collectives])
        kv = mb * SEQ * HIDDEN // tp * 2  # the whole sequence's K (or V) of this tp rank's heads, bf16
        assert (
            got["all_gather@cp"] == got["reduce_scatter@cp"] == {"count": 2 * LAYERS * m, "bytes": 2 * LAYERS * m * kv}
        )
        # the gradient sync of dp x cp replicas: what a cp = 1 plan of dp * cp replicas of S / cp tokens syncs over dp
        flat = hand_plan(g, cl, cpx.local_training(tr, cp), pp=pp, tp=tp, dp=dp * cp, micro_batch=mb)
        want = records.summary([c for s in flat.stages for c in s.collectives])
        assert got["all_reduce@dp_cp"] == want["all_reduce@dp"] and not any(k.endswith("@dp") for k in got)
        assert got["all_reduce@tp"] == want["all_reduce@tp"]  # tp's all-reduces of S / cp tokens, once each
        if pp == 2:  # each rank sends its own S / cp tokens' residual stream, forward and backward
            p2p = records.summary(plan.stages[0].collectives)["p2p@pp"]
            assert p2p == {"count": 2 * m, "bytes": 2 * m * mb * (SEQ // cp) * HIDDEN * 2}


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"sequence_parallel": True}, r"with context parallelism \(cp=2\) it has no Plan layout"),
        ({"pp": 2, "schedule": "zbv"}, "with the zbv schedule has no Plan layout"),
        ({"cp": 3}, "does not divide the sequence length"),
    ],
)
def test_hand_plan_refuses_cp_layouts_it_cannot_write(g, kw: dict, match: str) -> None:  # noqa: ANN001
    from partita.cluster import parse_cluster
    from partita.search.entry.hand_plan import hand_plan
    from partita.search.pricing.config import TrainingConfig

    args = {"tp": 2, "pp": 1, "dp": 2, "micro_batch": 1, "cp": 2, **kw}
    with pytest.raises(ConfigError, match=match):
        hand_plan(g, parse_cluster("64xH100-80G"), TrainingConfig(global_batch=8, seq_len=SEQ, dtype="bf16"), **args)


def test_hand_plan_lays_out_cp_in_interleaved_chunks() -> None:
    """An interleaved 1F1B layout with cp: the chunks of each rank group repeat its dp x cp x tp ranks,
    every chunk carries cp, and each hand-off carries the rank's S / cp tokens (the step evaluate prices)."""
    from partita.cluster import parse_cluster
    from partita.search.entry.evaluate import evaluate_config
    from partita.search.entry.hand_plan import hand_plan
    from partita.search.pricing.config import TrainingConfig

    cl, tr = parse_cluster("64xH100-80G"), TrainingConfig(global_batch=8, seq_len=SEQ, dtype="bf16")
    kw = dict(tp=1, pp=2, dp=1, micro_batch=1, cp=2, schedule="interleaved_1f1b", num_virtual=2)
    plan = hand_plan(gpt(4, HIDDEN, HEADS), cl, tr, **kw)
    assert plan.chunked and [(s.ranks, s.cp) for s in plan.stages] == [((0, 1), 2), ((2, 3), 2)] * 2
    ev = evaluate_config(gpt(4, HIDDEN, HEADS), cl, tr, tp_style="torch", **kw)
    assert plan.predicted["step_time_s"] == pytest.approx(ev.predicted_step_time_s, rel=1e-9)
    p2p = records.summary(plan.stages[0].collectives)["p2p@pp"]
    assert p2p["bytes"] == p2p["count"] * (SEQ // 2) * HIDDEN * 2  # one sample of S / cp tokens, bf16
