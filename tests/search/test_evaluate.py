"""``partita evaluate``: unbuildable layouts refused (exit 2), every searched dimension priced, memory by category."""

from __future__ import annotations

import pytest

from partita.cli import main
from partita.cluster import parse_cluster
from partita.errors import ConfigError
from partita.search.entry.evaluate import MEMORY_CATEGORIES, check_layout, evaluate_config, tp_dims
from partita.search.pricing.config import TrainingConfig
from tests.search.builders import gpt

TR = TrainingConfig(global_batch=16, seq_len=512)


@pytest.fixture(scope="module")
def g12():  # noqa: ANN201
    return gpt(4, 768, 12)  # GPT-2 small's block dims: 12 heads, hidden 768, ffn 3072


def test_tp_dims_reads_heads_and_weight_dims(g12) -> None:  # noqa: ANN001
    need, vocab = tp_dims(g12)
    assert need["attention heads"] == {12} and {768, 2304, 3072} <= need["block weight dims"] and vocab is None


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"tp": 5}, r"attention heads 12.*not divisible by 5.*1, 2, 3, 4, 6"),
        ({"tp": 8, "dp": 2, "pp": 1}, r"dp\*tp\*pp = 16 exceeds the cluster's 8 devices.*dp=1 fits"),
        ({"pp": 5}, r"4 blocks do not split into pp=5 stages: every stage needs at least one"),
        ({"dp": 3}, r"global batch 16 is not a multiple"),
        ({"pp": 2, "num_virtual": 2}, r"virtual stages need the interleaved_1f1b schedule"),
        ({"pp": 2, "num_virtual": 4, "schedule": "interleaved_1f1b"}, r"4 blocks do not split into pp=2 stages of 4"),
        ({"pp": 1, "num_virtual": 2, "schedule": "interleaved_1f1b"}, r"needs pp >= 2"),
    ],
)
def test_unbuildable_layouts_are_refused(g12, kw: dict, match: str) -> None:  # noqa: ANN001
    args = {"tp": 1, "pp": 1, "dp": 1, "micro_batch": 1} | kw
    with pytest.raises(ConfigError, match=match) as e:
        check_layout(g12, parse_cluster("8xA100-80G"), TR, **args)
    assert "Fix:" in str(e.value)


def test_tp_beyond_a_node_is_priced_over_the_network_and_said() -> None:
    g16 = gpt(2, 4096, 32)
    tr = TrainingConfig(global_batch=16, seq_len=2048)
    two_nodes = parse_cluster("16xA100-80G")
    one_big_node = parse_cluster("16xA100-80G", gpus_per_node=16)
    across = evaluate_config(g16, two_nodes, tr, tp=16, pp=1, dp=1, micro_batch=4)
    assert any("spans 2 nodes" in n and "network" in n for n in across.notes), across.notes
    inside = evaluate_config(g16, one_big_node, tr, tp=16, pp=1, dp=1, micro_batch=4)
    assert not any("spans" in n for n in inside.notes)
    assert across.predicted_step_time_s > 1.2 * inside.predicted_step_time_s  # IB, not NVLink


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_memory_categories_sum_to_the_priced_total(g12, zero: int, recompute: str) -> None:  # noqa: ANN001
    ev = evaluate_config(
        g12, parse_cluster("8xA100-80G"), TR, tp=2, pp=2, dp=2, micro_batch=2, zero_stage=zero, recompute=recompute
    )
    for cat, total in zip(ev.memory_by_category, ev.memory_per_device):
        assert set(cat) == set(MEMORY_CATEGORIES)
        assert sum(cat.values()) == pytest.approx(total, rel=1e-9)
    assert ev.fits == all(m <= ev.memory_capacity for m in ev.memory_per_device)


def test_zero_recompute_and_interleaving_change_what_they_should(g12) -> None:  # noqa: ANN001
    cl = parse_cluster("8xA100-80G")

    def ev(**kw):  # noqa: ANN003, ANN202
        return evaluate_config(g12, cl, TR, **({"tp": 1, "pp": 2, "dp": 4, "micro_batch": 1} | kw))

    z0, z1, z3 = ev(), ev(zero_stage=1), ev(zero_stage=3)
    c0, c1, c3 = (e.memory_by_category[0] for e in (z0, z1, z3))
    assert c1["optimizer_state"] == pytest.approx(c0["optimizer_state"] / 4)
    assert c3["parameters"] < c0["parameters"] and c1["parameters"] == c0["parameters"]
    none, sel, full = ev(), ev(recompute="selective"), ev(recompute="full")
    a = [e.memory_by_category[0]["activations"] for e in (none, sel, full)]
    assert a[0] >= a[1] > a[2]  # fused SDPA saves no score matrix: selective drops little or nothing here
    t = [e.predicted_step_time_s for e in (none, sel, full)]
    assert t[0] <= t[1] < t[2]
    inter = ev(schedule="interleaved_1f1b", num_virtual=2)
    assert inter.layout["num_virtual_stages"] == 2 and inter.bubble_s < none.bubble_s


def test_idle_devices_lower_cluster_mfu_and_are_noted(g12) -> None:  # noqa: ANN001
    from partita.passes.annotate import annotate

    g = annotate(g12)
    g.layers = g12.layers
    ev = evaluate_config(g, parse_cluster("8xA100-80G"), TR, tp=1, pp=1, dp=2, micro_batch=1)
    assert ev.layout["devices_used"] == 2 and ev.layout["devices_total"] == 8
    assert ev.mfu_cluster == pytest.approx(ev.mfu * 2 / 8) and 0 < ev.mfu < 1
    assert any("6 of 8 devices stay idle" in n for n in ev.notes)
    assert ev.layout["calibration"].startswith("partita:") and "8 x 200 Gb/s" in ev.layout["network"]


def test_cli_tp5_on_gpt2_exits_2_with_one_paragraph(capsys) -> None:
    argv = ["evaluate", "gpt2", "--cluster", "8xA100-80G", "--global-batch", "8", "--seq", "128", "--tp", "5"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "tp=5 cannot split" in err and "attention heads 12" in err and "Fix:" in err and "Traceback" not in err


def test_v100_layout_is_priced_in_fp16_and_says_so(g12) -> None:  # noqa: ANN001
    cl = parse_cluster("8xV100-32G")
    ev = evaluate_config(g12, cl, TR, tp=1, pp=1, dp=8, micro_batch=2)
    assert ev.layout["dtype"] == "f16" and any("no bf16 tensor cores" in n for n in ev.notes), ev.notes
    from partita.search.pipeline.stage_cost import SolverCosts

    held = evaluate_config(
        g12, cl, TR, tp=1, pp=1, dp=8, micro_batch=2, costs=SolverCosts(g12, cl, TR, tp_style="megatron")
    )
    assert held.layout["dtype"] == "bf16" and held.predicted_step_time_s > 1.5 * ev.predicted_step_time_s


def test_zb_h1_prices_each_stage_with_its_own_deferred_weight_gradients() -> None:
    """Under zb_h1 a micro-batch between its B and its W weighs its stage's own output gradients: the stage
    with the head (logits) holds relatively more than the blocks' stage, and the activations differ from
    1F1B's by exactly the per-stage counts, each position's own (search/pipeline/zero_bubble.py)."""
    from partita.frontends.trace import trace_handle
    from partita.ir import DTYPE_BYTES
    from partita.models import resolve_model
    from partita.passes import boundaries
    from partita.search.pipeline import schedule as sched
    from partita.search.pipeline.stage_cost import SolverCosts, costs_held

    g = trace_handle(resolve_model("gpt2-tiny"), batch=1, seq=32)
    tr = TrainingConfig(global_batch=16, seq_len=32)
    cl = parse_cluster("8xA100-80G")
    kw = {"tp": 1, "pp": 2, "dp": 2, "micro_batch": 1}
    one, zb, gp = (evaluate_config(g, cl, tr, schedule=s, **kw) for s in ("1f1b", "zb_h1", "gpipe"))
    assert zb.layout["schedule"] == "zb_h1" and zb.bubble_s < one.bubble_s
    m, names = zb.layout["num_micro_batches"], [lay.name for lay in g.layers]
    helds = []
    for i, (a, b, c) in enumerate(zip(one.memory_by_category, zb.memory_by_category, gp.memory_by_category)):
        layers = [n for n in names if n in _stage_layers(g, 2, i)]
        # the stage's own output gradients over its saved activations, as its option prices them (ZeRO-0:
        # the torch.autocast program; evaluate_config's tp_style megatron)
        costs = SolverCosts(g, cl, tr, tp_style="megatron")
        lcs = [
            costs.layer(li, cl.device_types()[0], 1, 1)[0]
            for li in range(names.index(layers[0]), names.index(layers[-1]) + 1)
        ]
        held = costs_held(lcs, names.index(layers[0]) == 0, True)
        helds.append(held)
        count = sched.peak_in_flight("zb_h1", 2, m, 1, held)[i]  # position i: rank i's action list
        # activations = saved x count + a transient (the last stage's loss buffers): GPipe (m in flight)
        # and 1F1B separate the two
        c1 = sched.in_flight("1f1b", i, 2, m)
        # GPipe: all m at its last forward, or m - 1 beside the gradients the first backward made (a later
        # backward, stage_ranges.StageParts.memory), whichever is larger: its gradients category says which
        c_held = m - 1 if c["gradients"] else m
        saved = (c["activations"] - a["activations"]) / (c_held - c1)
        # 1F1B and GPipe run on torch.distributed.pipelining, which holds a receive buffer per micro-batch
        # (search/program/receive_buffers.py: the one boundary, activations in on stage 1, gradients on 0);
        # zb_h1's runner receives each when it comes
        cut = max(names.index(n) for n in _stage_layers(g, 2, 0))
        buffers = m * boundaries.cut_elems(g, cut, 32) * DTYPE_BYTES[tr.dtype]
        transient = a["activations"] - buffers - saved * c1
        assert transient >= 0 and (transient > 0) == (i == 1)
        assert b["activations"] == pytest.approx(saved * count + transient, rel=1e-9)
        assert c["activations"] == pytest.approx(saved * c_held + transient + buffers, rel=1e-9)
        assert {k: v for k, v in a.items() if k != "activations"} == {k: v for k, v in b.items() if k != "activations"}
    # the first stage's B computes nothing (its input needs no gradient), so nothing but its activations waits
    # for its W; the last stage's deferred W holds the output gradients too (the logits' is large)
    assert helds[0] == 1.0 < helds[1]


def _stage_layers(g, pp: int, i: int) -> set[str]:  # noqa: ANN001
    from partita.search.entry.evaluate import megatron_split

    a, b = megatron_split(g, pp)[i]
    return {lay.name for lay in g.layers[a:b]}


def test_zb_h1_refuses_what_no_runtime_runs_and_the_cli_accepts_it(g12, capsys) -> None:  # noqa: ANN001
    cl = parse_cluster("8xA100-80G")
    kw = {"tp": 1, "pp": 2, "dp": 2, "micro_batch": 1, "schedule": "zb_h1"}
    for extra, match in (({"zero_stage": 2}, "ZeRO-2 reduce-scatters"), ({"recompute": "full"}, "second backward")):
        with pytest.raises(ConfigError, match=match) as e:
            evaluate_config(g12, cl, TR, **kw, **extra)
        assert "Fix:" in str(e.value)
    assert evaluate_config(g12, cl, TR, **kw, zero_stage=1).layout["zero_stage"] == 1
    argv = ["evaluate", "gpt2-tiny", "--cluster", "4xA100-80G", "--global-batch", "8", "--seq", "32"]
    assert main([*argv, "--pp", "2", "--dp", "2", "--schedule", "zb_h1", "--json"]) == 0
    assert '"schedule": "zb_h1"' in capsys.readouterr().out
    assert main([*argv, "--pp", "2", "--dp", "2", "--schedule", "zb_h1", "--zero", "3"]) == 2
    err = capsys.readouterr().err
    assert "ZeRO-3" in err and "Fix:" in err and "Traceback" not in err


def test_uneven_stage_split_is_priced_with_lighter_end_stages(g12) -> None:  # noqa: ANN001
    """Issue 32: a layer count pp does not divide (Llama 3 405B: 126 layers on 16 stages) is a layout
    that ran; the end stages hold one block fewer, and compile builds the very ranges evaluate priced."""
    from partita.search.entry.evaluate import blocks_per_stage, megatron_split
    from partita.search.entry.hand_plan import hand_plan

    assert blocks_per_stage(126, 16) == [7] + [8] * 14 + [7]
    assert blocks_per_stage(4, 3) == [1, 2, 1] and blocks_per_stage(5, 3) == [1, 2, 2]
    cl = parse_cluster("8xA100-80G")
    kw = {"tp": 1, "pp": 3, "dp": 2, "micro_batch": 1}
    ev = evaluate_config(g12, cl, TR, **kw)
    assert any("one fewer on stages 0, 2" in n for n in ev.notes)
    blocks = [sum(lay.kind == g12.layers[1].kind for lay in g12.layers[a:b]) for a, b in megatron_split(g12, 3)]
    assert blocks == [1, 2, 1]
    plan = hand_plan(g12, cl, TR, **kw)
    assert [len(s.layers) for s in plan.stages] == [b - a for a, b in megatron_split(g12, 3)]


def test_fsdp_overlap_interference_is_priced_linearly_and_only_for_zero_2_3(g12) -> None:  # noqa: ANN001
    """Overlap is not free (issue 32): a ZeRO-3 micro-batch costs max(t, sync) + rho * min(t, sync), rho the
    device's Efficiency.overlap_interference; ZeRO-1 (no in-micro-batch traffic) is unchanged; CPU has none."""
    import dataclasses

    from partita.search.pipeline.stage_cost import SolverCosts
    from partita.search.pricing.cost_model import CPU_EFFICIENCY, CostModel, Efficiency

    cl = parse_cluster("8xH100-80G")
    dev = cl.groups[0].device
    base = CostModel.for_device(dev).efficiency
    assert base.overlap_interference == 0.2 and CPU_EFFICIENCY.overlap_interference == 0.0

    def ev(rho: float, zero: int) -> float:
        costs = SolverCosts(g12, cl, TR, tp_style="torch")
        costs._cm[dev.name] = CostModel(dev, dataclasses.replace(base, overlap_interference=rho))
        kw = {"tp": 1, "pp": 1, "dp": 8, "micro_batch": 1, "zero_stage": zero}
        return evaluate_config(g12, cl, TR, costs=costs, tp_style="torch", **kw).predicted_step_time_s

    t0, t1, t2 = ev(0.0, 3), ev(0.2, 3), ev(0.4, 3)
    assert t1 > t0 and (t2 - t0) == pytest.approx(2 * (t1 - t0), rel=1e-9)
    assert ev(0.0, 1) == pytest.approx(ev(0.4, 1), rel=1e-12)
    with pytest.raises(Exception, match="overlap_interference"):
        Efficiency(overlap_interference=1.5)
