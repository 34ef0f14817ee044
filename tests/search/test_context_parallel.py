"""Context parallelism priced (issue 36): the all-gather-K/V terms against closed forms of the block's
shape, ``evaluate --cp`` (devices, tokens, memory split by cp, gradient sync over dp x cp), refusals."""

from __future__ import annotations

import pytest

from partita.cli import main
from partita.cluster import parse_cluster
from partita.errors import ConfigError
from partita.search.entry.evaluate import evaluate_config
from partita.search.pricing import context_parallel as cpx
from partita.search.pricing.config import TrainingConfig
from partita.search.pricing.cost_model import CostModel, Efficiency
from tests.search.builders import gpt, mlp

HIDDEN, HEADS = 1024, 16
TR = TrainingConfig(global_batch=8, seq_len=16384)


@pytest.fixture(scope="module")
def g():  # noqa: ANN201
    return gpt(4, HIDDEN, HEADS)


def _block(g):  # noqa: ANN001, ANN202
    return next(lay for lay in g.layers if cpx.attention_nodes(g, lay))


@pytest.mark.parametrize("cp, tp, b", [(2, 1, 1), (4, 2, 2), (16, 8, 1)])
def test_terms_match_the_closed_forms_of_the_block(g, cp: int, tp: int, b: int) -> None:  # noqa: ANN001
    """Per attention, per micro-batch: K and V of the whole sequence gathered (2 x b x S x hidden / tp, bf16),
    the local queries against S keys instead of S / cp (4 b h d (S^2/cp - (S/cp)^2) / tp more FLOPs, 2x in
    the backward), the gathered K/V beyond the local slice saved; the forward all-gathers and the backward
    reduce-scatters priced on the cp axis' link (ranks dp, cp, tp: tp fastest)."""
    cl = parse_cluster("256xH100-80G")
    dev = cl.device_types()[0]
    cm = CostModel(dev, Efficiency())
    link = cpx.cp_link(dev, cp, tp, cl.gpus_per_node(dev.name), cl.network_for(dev.name))
    assert link.size == cp and link.crosses_nodes == (cp * tp > 8)
    s = TR.seq_len
    t = cpx.layer_terms(g, _block(g), cm, link, cp=cp, tp=tp, micro_batch=b, local_seq=s // cp, dtype="bf16")
    whole = 2 * b * s * HIDDEN / tp * 2  # K + V, all heads of this tp rank, bf16
    assert t.num_attention == 1 and t.gathered_bytes == pytest.approx(whole)
    assert t.extra_saved_bytes == pytest.approx(whole * (cp - 1) / cp)
    flops = 4 * b * HIDDEN / tp * (s * s / cp - (s / cp) ** 2)
    peak = dev.flops("bf16") * Efficiency().attention
    assert t.extra_forward_s == pytest.approx(flops / peak, rel=1e-9)
    assert t.extra_backward_s == pytest.approx(2 * flops / peak, rel=1e-9)
    bw = link.bandwidth * (Efficiency().network_bandwidth if link.crosses_nodes else Efficiency().collective_bandwidth)
    one = (cp - 1) / cp * (whole / 2) / bw + (cp - 1) * link.latency + Efficiency().collective_latency_s
    assert t.gather_s == pytest.approx(2 * one) and t.scatter_s == pytest.approx(2 * one)


def test_a_layer_without_attention_adds_nothing() -> None:
    cl = parse_cluster("8xH100-80G")
    dev = cl.device_types()[0]
    link = cpx.cp_link(dev, 2, 1, 8, cl.network_for(dev.name))
    m = mlp(256, 1024)
    lay = m.layers[0]
    assert not cpx.attention_nodes(m, lay)
    assert (
        cpx.layer_terms(m, lay, CostModel(dev), link, cp=2, tp=1, micro_batch=1, local_seq=64, dtype="bf16")
        == cpx.CPTerms()
    )


def test_evaluate_splits_the_sequence_over_cp(g) -> None:  # noqa: ANN001
    """cp=4 against cp=1 at the same dp, tp, pp: 4x the devices, the same tokens per step, activations per
    device about a quarter (plus the gathered K/V), parameters replicated over cp (ZeRO-0), gradients synced
    over dp x cp; the model FLOPs are the whole sequence's (MFU against the devices used)."""
    cl = parse_cluster("64xH100-80G")
    kw = dict(tp=2, pp=1, dp=2, micro_batch=1, tp_style="torch")
    one = evaluate_config(g, cl, TR, **kw)
    four = evaluate_config(g, cl, TR, cp=4, **kw)
    assert (four.layout["cp"], four.layout["devices_used"], one.layout["devices_used"]) == (4, 16, 4)
    assert four.tokens_per_s * four.predicted_step_time_s == pytest.approx(TR.global_batch * TR.seq_len)
    assert four.layout["num_micro_batches"] == one.layout["num_micro_batches"] == 4
    a1, a4 = one.memory_by_category[0]["activations"], four.memory_by_category[0]["activations"]
    assert 0.25 * a1 < a4 < 0.4 * a1
    assert four.memory_by_category[0]["parameters"] == pytest.approx(one.memory_by_category[0]["parameters"])
    assert four.tail_s > one.tail_s  # the gradient all-reduce spans dp x cp = 8 ranks, not 2
    assert four.predicted_step_time_s < one.predicted_step_time_s  # a quarter of the tokens per device
    assert four.mfu * 4 * four.predicted_step_time_s == pytest.approx(one.mfu * one.predicted_step_time_s, rel=1e-6)
    assert any(
        "context parallelism cp=4 (all_gather_kv)" in n and "4,096 of every sample's 16,384" in n for n in four.notes
    )
    per_block = four.layout["context_parallel"]
    assert per_block["gathered_bytes_per_block"] == pytest.approx(2 * 1 * TR.seq_len * HIDDEN / 2 * 2)  # K+V, b 1, tp 2
    assert (per_block["tokens_per_rank"], per_block["crosses_nodes"]) == (4096, False)  # cp x tp = 8: one node
    assert "context_parallel" not in one.layout
    from partita.report import evaluate_text

    text = " ".join(evaluate_text(four.to_dict(), width=200).split())
    assert "dp 2 x cp 4 x tp 2 x pp 1 on 16 of 64 devices" in text


def test_zero_shards_over_dp_times_cp(g) -> None:  # noqa: ANN001
    cl = parse_cluster("64xH100-80G")
    kw = dict(tp=1, pp=1, micro_batch=1, zero_stage=3, tp_style="torch")
    dp8 = evaluate_config(g, cl, TR, dp=8, **kw)
    dp2cp4 = evaluate_config(g, cl, TR, dp=2, cp=4, **kw)
    assert dp2cp4.memory_by_category[0]["parameters"] == pytest.approx(dp8.memory_by_category[0]["parameters"])
    assert dp2cp4.memory_by_category[0]["optimizer_state"] == pytest.approx(
        dp8.memory_by_category[0]["optimizer_state"]
    )


@pytest.mark.parametrize(
    "graph, kw, match",
    [
        ("gpt", {"cp": 3}, r"cp=3 does not divide the sequence length 16384.*2, 4, 8, 16, 32"),
        ("gpt", {"cp": 0}, r"cp=0 must be >= 1"),
        ("gpt", {"cp": 8, "dp": 2, "tp": 8}, r"dp\*cp\*tp\*pp = 128 exceeds the cluster's 64 devices"),
        ("mlp", {"cp": 2}, r"traced without a symbolic sequence length"),
    ],
)
def test_unbuildable_context_parallel_layouts_are_refused(g, graph: str, kw: dict, match: str) -> None:  # noqa: ANN001
    args = {"tp": 1, "pp": 1, "dp": 1, "micro_batch": 1} | kw
    model = g if graph == "gpt" else mlp(256, 1024)
    with pytest.raises(ConfigError, match=match) as e:
        evaluate_config(model, parse_cluster("64xH100-80G"), TR, **args)
    assert "Fix:" in str(e.value)


def test_cli_refuses_a_cp_not_dividing_the_sequence_before_tracing(capsys: pytest.CaptureFixture) -> None:
    rc = main(["evaluate", "gpt2-tiny", "--cluster", "8xCPU", "--global-batch", "8", "--seq", "30", "--cp", "4"])
    err = capsys.readouterr().err
    assert rc == 2 and "cp=4 does not divide the sequence length 30" in err and "Traceback" not in err


def test_cli_evaluate_prices_cp(g, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    """``partita evaluate --cp`` through the CLI and the driver (the trace replaced by the builder's graph, so
    no torch): the JSON layout is the one asked, on dp x cp x tp x pp devices, with the note saying what cp costs."""
    import json
    import types

    import partita.driver

    monkeypatch.setattr(partita.driver, "trace_model", lambda *a, **k: types.SimpleNamespace(graph=g))
    argv = ["evaluate", "gpt2-tiny", "--cluster", "64xH100-80G", "--global-batch", "8", "--seq", "16384"]
    rc = main([*argv, "--tp", "8", "--dp", "2", "--cp", "4", "--micro-batch", "1", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and (out["layout"]["cp"], out["layout"]["devices_used"]) == (4, 64)
    assert out["layout"]["context_parallel"]["tokens_per_rank"] == 4096
    assert any("context parallelism cp=4 (all_gather_kv)" in n for n in out["notes"])


def test_cp_adds_its_terms_once_per_block_and_micro_batch(g) -> None:  # noqa: ANN001
    """The wiring: a cp layout costs what dp x cp replicas of S / cp tokens cost (the same layout without cp at
    the local sequence, cp times the samples) plus, per micro-batch and block, the attention terms; its
    activations exceed theirs by the gathered K/V kept per micro-batch in flight."""
    import dataclasses

    cl = parse_cluster("64xH100-80G")
    cp, dp, b = 4, 2, 2
    kw = dict(tp=2, pp=1, micro_batch=b, tp_style="torch")
    with_cp = evaluate_config(g, cl, TR, dp=dp, cp=cp, **kw)
    local = dataclasses.replace(TR, seq_len=TR.seq_len // cp, global_batch=TR.global_batch * cp)
    plain = evaluate_config(g, cl, local, dp=dp * cp, **kw)
    dev = cl.device_types()[0]
    link = cpx.cp_link(dev, cp, 2, 8, cl.network_for(dev.name))
    t = cpx.layer_terms(
        g,
        _block(g),
        CostModel.for_device(dev),
        link,
        cp=cp,
        tp=2,
        micro_batch=b,
        local_seq=TR.seq_len // cp,
        dtype="bf16",
    )
    m = with_cp.layout["num_micro_batches"]
    blocks = len(g.layers)
    per_mb = t.extra_forward_s + t.extra_backward_s + t.comm_s
    assert with_cp.predicted_step_time_s - plain.predicted_step_time_s == pytest.approx(m * blocks * per_mb, rel=1e-6)
    extra = with_cp.memory_by_category[0]["activations"] - plain.memory_by_category[0]["activations"]
    assert extra == pytest.approx(blocks * t.extra_saved_bytes, rel=1e-6)  # one micro-batch in flight (pp 1)
