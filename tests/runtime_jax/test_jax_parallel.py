"""Unit tests of the JAX runtime helpers: layouts, stage split, schedules, HLO collective parsing.

In-process and device-count independent (the split runs on whatever default device JAX has).
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from partita.errors import PlanError
from partita.models.jax_gpt import gpt_handle, mlp_handle
from partita.runtime import jax_parallel as jp

GPT_LAYERS = ["wte", "wpe", "blocks_0", "blocks_1", "ln_f", "lm_head"]


def test_partition_spec_per_dim_axes() -> None:
    assert jp.partition_spec(("S(0)", "R"), (8, 4), (2, 2)) == P("dp", None)
    assert jp.partition_spec(("R", "S(1)"), (8, 4), (2, 2)) == P(None, "tp")
    assert jp.partition_spec(("S(0)", "S(0)"), (8, 4), (2, 2)) == P(("dp", "tp"), None)
    assert jp.partition_spec(("R", "S(-1)"), (8, 4), (2, 2)) == P(None, "tp")
    with pytest.raises(PlanError, match="does not split"):
        jp.partition_spec(("R", "S(1)"), (8, 3), (2, 2), "w")
    with pytest.raises(PlanError, match="cannot lay out"):
        jp.partition_spec(("P", "R"), (8, 4), (2, 2), "w")


def test_zero_spec_adds_dp_once() -> None:
    assert jp.zero_spec(P(None, "tp"), (64, 256), (4, 2)) == P(None, ("tp", "dp"))
    assert jp.zero_spec(P(), (256, 64), (4, 1)) == P("dp", None)
    assert jp.zero_spec(P("dp"), (8,), (4, 1)) == P("dp")  # already over dp
    assert jp.zero_spec(P(), (3,), (4, 1)) == P()  # nothing divides: stays replicated


@pytest.mark.parametrize("cut", [[6], [3, 3], [1, 2, 3]])
def test_split_model_composes_to_the_loss(cut: list[int]) -> None:
    h = gpt_handle()
    params = h.init_params(0)
    batch = jp.make_batch(h, 4, 16, 0)
    stage_layers, at = [], 0
    for n in cut:
        stage_layers.append(GPT_LAYERS[at : at + n])
        at += n
    split = jp.split_model(h.loss_fn, h.abstract_params(), batch, GPT_LAYERS, stage_layers)
    flat = jp.flatten(params)
    assert sorted(f for s in split.stages for f in s.param_fqns) == sorted(flat)
    for st, names in zip(split.stages, stage_layers):  # every parameter lands on its layer's stage
        assert all(f.split(".")[1] in names for f in st.param_fqns), (st.index, st.param_fqns)
    values = dict(zip(split.batch_ids, batch))
    for st in split.stages:
        outs = jax.jit(st.apply)({f: flat[f] for f in st.param_fqns}, [values[i] for i in st.inputs])
        values.update(zip(st.outputs, outs))
    np.testing.assert_allclose(values[split.loss_id], jax.jit(h.loss_fn)(params, *batch), rtol=1e-6)
    if len(cut) > 1:  # the residual stream crosses the boundary after blocks_0
        assert [split.avals[i].shape for i in split.stages[0].outputs] == [(4, 16, 64)]


def test_split_model_rejects_unknown_layer_names() -> None:
    h = mlp_handle()
    batch = jp.make_batch(h, 4, 0, 0)
    with pytest.raises(PlanError, match="got no part of the model"):
        jp.split_model(h.loss_fn, h.abstract_params(), batch, ["layer_0", "layer_1"], [["layer_0"], ["layer_1"]])


def test_split_model_stage_order_must_follow_layers() -> None:
    h = mlp_handle()
    batch = jp.make_batch(h, 4, 0, 0)
    with pytest.raises(PlanError, match="model order"):
        jp.split_model(h.loss_fn, h.abstract_params(), batch, ["fc1", "fc2"], [["fc2"], ["fc1"]])


@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p,m", [(2, 2), (3, 4), (4, 8)])
def test_pipeline_schedule_is_complete_and_causal(kind: str, p: int, m: int) -> None:
    acts = jp.pipeline_schedule(kind, p, m)
    expected = {("F", s, i) for s in range(p - 1) for i in range(m)} | {("B", s, i) for s in range(p) for i in range(m)}
    assert set(acts) == expected and len(acts) == len(expected)
    pos = {a: k for k, a in enumerate(acts)}
    for s in range(p):
        for i in range(m):
            if s < p - 1:
                assert pos[("F", s, i)] < pos[("B", s + 1, i)] < pos[("B", s, i)]
            if 0 < s < p - 1:
                assert pos[("F", s - 1, i)] < pos[("F", s, i)]
    if kind == "1f1b":  # stage 0 keeps at most p-1 micro-batches in flight before its first backward
        first = [a for a in acts if a[1] == 0]
        assert first.index(("B", 0, 0)) == min(p, m)
    else:
        first = [a for a in acts if a[1] == 0]
        assert first == [("F", 0, i) for i in range(m)] + [("B", 0, i) for i in range(m)]


HLO = """
  %all-reduce.10 = (f32[256]{0}, /*index=1*/f32[64,256]{1,0}, f32[]) all-reduce(%a, %b, %c), channel_id=2, replica_groups=mesh['axis_0'=4,'axis_1'=1] {'axis_0'}, use_global_device_ids=true, to_apply=%add, metadata={op_name="jit(step)/(transpose(jvp(MLP))/fc1/reduce_sum:transpose(jvp(MLP))/fc1/dot_general:jvp()/reduce_sum)"}
  %all-reduce.5 = f32[4,16,64]{2,1,0} all-reduce(%x), channel_id=6, replica_groups={{0,1,2,3},{4,5,6,7}}, use_global_device_ids=true, to_apply=%add, metadata={op_name="jit(step)/jvp(GPT)/blocks_0/mlp/proj/dot_general"}
  %all-gather.2 = f32[256,64]{0,1} all-gather(%w), channel_id=3, replica_groups=mesh['axis_0'=1,'axis_1'=4] {'axis_1'}, dimensions={1}, use_global_device_ids=true
  %all-gather.3 = f32[8,64]{1,0} all-gather(%w), channel_id=4, replica_groups=[4,2]<=[2,4]T(1,0), dimensions={0}, use_global_device_ids=true
  ROOT %cp = f32[8]{0} collective-permute(%y), channel_id=5, source_target_pairs={{0,1},{1,0}}
  %get-tuple-element.1 = f32[256]{0} get-tuple-element(%all-reduce.10), index=0
"""


def test_count_collectives_reads_every_hlo_form() -> None:
    c = jp.count_collectives(HLO, (2, 4))
    assert (c["all-reduce"], c["all-gather"], c["collective-permute"], c["reduce-scatter"]) == (2, 2, 1, 0)
    assert c["operands"]["all-reduce"] == 4
    assert c["elements"]["all-reduce"] == 256 + 64 * 256 + 1 + 4 * 16 * 64
    # mesh['axis_0'=4,'axis_1'=1]{'axis_0'}: groups {0..3} on a (2, 4) mesh are one dp row -> tp
    assert c["by_axis"] == {"all-reduce@tp": 2, "all-gather@tp": 1, "all-gather@dp": 1, "collective-permute@tp": 1}
    assert c["by_phase"]["all-reduce@backward"] == 2 and c["by_phase"]["all-reduce@forward"] == 2


def test_predicted_collectives_sum_by_kind() -> None:
    from partita.plan import Collective

    pred = jp.predicted_collectives(
        [
            Collective("all_reduce", "tp", 1e6, 4),
            Collective("all_reduce", "dp", 1e6, 1),
            Collective("p2p", "pp", 1.0, 2),
        ]
    )
    assert pred["all-reduce"] == 5 and pred["collective-permute"] == 2
    assert pred["by_axis"] == {"all-reduce@tp": 4, "all-reduce@dp": 1, "collective-permute@pp": 2}
