"""Unit tests of the JAX fidelity side: HLO collective parsing and the plan's JAX prediction."""

from __future__ import annotations

from jax.sharding import PartitionSpec as P

from partita.backends.jax import fidelity as fid
from partita.plan import Collective, Stage

HLO = """
  %all-reduce.10 = (f32[256]{0}, /*index=1*/f32[64,256]{1,0}, f32[]) all-reduce(%a, %b, %c), channel_id=2, replica_groups=mesh['axis_0'=4,'axis_1'=1] {'axis_0'}, use_global_device_ids=true, to_apply=%add, metadata={op_name="jit(step)/(transpose(jvp(MLP))/fc1/reduce_sum:transpose(jvp(MLP))/fc1/dot_general:jvp()/reduce_sum)"}
  %all-reduce.5 = f32[4,16,64]{2,1,0} all-reduce(%x), channel_id=6, replica_groups={{0,1,2,3},{4,5,6,7}}, use_global_device_ids=true, to_apply=%add, metadata={op_name="jit(step)/jvp(GPT)/blocks_0/mlp/proj/dot_general"}
  %all-gather.2 = f32[256,64]{0,1} all-gather(%w), channel_id=3, replica_groups=mesh['axis_0'=1,'axis_1'=4] {'axis_1'}, dimensions={1}, use_global_device_ids=true
  %all-gather.3 = f32[8,64]{1,0} all-gather(%w), channel_id=4, replica_groups=[4,2]<=[2,4]T(1,0), dimensions={0}, use_global_device_ids=true
  ROOT %cp = f32[8]{0} collective-permute(%y), channel_id=5, source_target_pairs={{0,1},{1,0}}
  %get-tuple-element.1 = f32[256]{0} get-tuple-element(%all-reduce.10), index=0
"""


def test_count_collectives_reads_every_hlo_form() -> None:
    c = fid.count_collectives(HLO, (2, 4))
    assert (c["all-reduce"], c["all-gather"], c["collective-permute"], c["reduce-scatter"]) == (2, 2, 1, 0)
    assert c["operands"]["all-reduce"] == 4
    assert c["elements"]["all-reduce"] == 256 + 64 * 256 + 1 + 4 * 16 * 64
    # mesh['axis_0'=4,'axis_1'=1]{'axis_0'}: groups {0..3} on a (2, 4) mesh are one dp row -> tp
    assert c["by_axis"] == {"all-reduce@tp": 2, "all-gather@tp": 1, "all-gather@dp": 1, "collective-permute@tp": 1}
    assert c["by_phase"]["all-reduce@backward"] == 2 and c["by_phase"]["all-reduce@forward"] == 2
    # bytes per device of the whole operand (f32): the all-gathers' results, the all-reduces' operands
    assert c["bytes"]["all-reduce@tp"] == 4 * (256 + 64 * 256 + 1 + 4 * 16 * 64)
    assert c["bytes"]["all-gather@tp"] == 4 * 256 * 64 and c["bytes"]["all-gather@dp"] == 4 * 8 * 64


def test_reduce_scatter_bytes_are_the_whole_operand() -> None:
    line = (
        "  %rs = f32[8,64]{1,0} reduce-scatter(%g), channel_id=1, replica_groups={{0,2,4,6},{1,3,5,7}}, "
        "dimensions={0}, to_apply=%add"
    )
    c = fid.count_collectives(line, (4, 2))
    assert c["by_axis"] == {"reduce-scatter@dp": 1}  # the dp columns of a (4, 2) mesh
    assert list(c["bytes"].values()) == [4 * 8 * 64 * 4]  # result x group size


def _stage(zero: int, dp: int = 4, tp: int = 2, colls: tuple = ()) -> Stage:
    return Stage(0, ("l",), "CPU", tuple(range(dp * tp)), dp, tp, zero_stage=zero, collectives=colls)


# (shape, itemsize, parameter spec, optimizer-state spec) as the emitter passes them
PARAMS = {
    "w": ((64, 256), 4, P(None, "tp"), P(None, ("tp", "dp"))),  # 64 x 128 per tp shard
    "b": ((3,), 4, P(), P()),  # no dp layout divides 3
}


def test_prediction_follows_zero_stage() -> None:
    sync = Collective("all_reduce", "dp", 123.0, 1, "optimizer", "gradient sync (dp)")
    act = Collective("all_reduce", "tp", 1000.0, 2, "forward", "row-parallel")
    w_bytes, b_bytes = 64 * 128 * 4, 3 * 4
    z0 = fid.predict_stage(_stage(0, colls=(sync, act)), 2, PARAMS)
    # the gradient sync's bytes come from the layouts (tp shard of w + b), not the plan's 123
    assert z0 == {
        "all-reduce@dp": {"ops": 1, "bytes": w_bytes + b_bytes, "why": ["gradient sync (one combined op)"]},
        "all-reduce@tp": {"ops": 2, "bytes": 2000.0, "why": ["row-parallel"]},
    }
    rs = Collective("reduce_scatter", "dp", 123.0, 1, "optimizer", "gradient sync (dp)")
    z1 = fid.predict_stage(_stage(1, colls=(rs,)), 2, PARAMS)
    assert {k: (v["ops"], v["bytes"]) for k, v in z1.items()} == {
        "reduce-scatter@dp": (1, w_bytes),  # per dp-sharded tensor
        "all-reduce@dp": (1, b_bytes),  # the tensor ZeRO cannot shard
        "all-gather@dp": (1, w_bytes),  # the updated parameters, once per step
    }
    z3 = fid.predict_stage(_stage(3, colls=(Collective("reduce_scatter", "dp", 1.0, 2, "optimizer"),)), 2, PARAMS)
    assert {k: (v["ops"], v["bytes"]) for k, v in z3.items()} == {
        "reduce-scatter@dp": (2, 2 * w_bytes),
        "all-reduce@dp": (2, 2 * b_bytes),  # one combined op per micro-batch
        "all-gather@dp": (2, 2 * w_bytes),  # once per micro-batch
    }


def test_compare_reports_ops_and_bytes() -> None:
    pred = {"all-reduce@dp": {"ops": 1, "bytes": 100.0, "why": []}}
    assert fid.compare({"all-reduce@dp": {"ops": 1, "bytes": 100.0}}, pred) == []
    assert fid.compare({"all-reduce@dp": {"ops": 2, "bytes": 100.0}}, pred) == [
        "all-reduce@dp: measured 2 ops / 100 B, predicted 1 ops / 100 B"
    ]
    assert len(fid.compare({"all-gather@tp": {"ops": 1, "bytes": 8.0}}, pred)) == 2
