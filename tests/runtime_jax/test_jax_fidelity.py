"""Unit tests of the JAX fidelity side: HLO collective parsing and the plan's JAX records (search/program/jax_records.py)."""

from __future__ import annotations

from jax.sharding import PartitionSpec as P

from partita.backends.jax import fidelity as fid
from partita.backends.jax import parallel as jp
from partita.backends.jax.train import _axis_dim
from partita.plan import Collective, Stage
from partita.search.program import jax_records as jr

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


def _held(zero: int, dp: int = 4, tp: int = 2) -> list[jr.HeldParam]:
    """w (64, 256) split over tp on dim 1, b (3,) replicated, as ``jax_records.stage_params`` holds them."""
    w = jr.HeldParam("w", (64, 256), 4, (1,), jr.zero_dim((64, 256), (1,), dp, tp) if zero else None)
    b = jr.HeldParam("b", (3,), 4, (), jr.zero_dim((3,), (), dp, tp) if zero else None)
    return [w, b]


def test_records_follow_zero_stage() -> None:
    """The JAX records (search/program/jax_records.py) per ZeRO stage: one record per HLO op and tensor, bytes of
    the tp shard (the whole tensor a dp collective moves), folded by ``fidelity.planned`` per step."""
    w_bytes, b_bytes, m = 64 * 128 * 4, 3 * 4, 2

    def folded(zero: int) -> dict[str, tuple[int, float]]:
        st = _stage(zero, colls=tuple(jr.dp_records(_held(zero), 4, 2, zero, m)))
        return {k: (v["ops"], v["bytes"]) for k, v in fid.planned(st).items()}

    assert folded(0) == {"all-reduce@dp": (1, w_bytes + b_bytes)}  # one psum of every gradient
    assert folded(1) == {
        "reduce-scatter@dp": (1, w_bytes),  # per dp-sharded tensor, once
        "all-reduce@dp": (1, b_bytes),  # the tensor ZeRO cannot shard
        "all-gather@dp": (1, w_bytes),  # the updated parameters, once per step
    }
    assert folded(2) == {"reduce-scatter@dp": (m, m * w_bytes), "all-reduce@dp": (m, m * b_bytes)} | {
        "all-gather@dp": (1, w_bytes)
    }
    assert folded(3) == {
        "reduce-scatter@dp": (m, m * w_bytes),
        "all-reduce@dp": (m, m * b_bytes),  # one psum per micro-batch
        "all-gather@dp": (m, m * w_bytes),  # once per micro-batch: the backward keeps the gathered copy
    }
    assert jr.dp_records(_held(3, dp=1), 1, 2, 3, m) == []


def test_zero_dim_is_the_programs_zero_spec() -> None:
    """The records' ZeRO layout (search side, no JAX) is the one the program applies (parallel.zero_spec)."""
    cases = [((64, 256), (1,)), ((3,), ()), ((12, 8), ()), ((8, 12), (0,)), ((6, 4, 16), (2,)), ((5, 7), ())]
    for shape, tp_dims in cases:
        for dp, tp in ((2, 1), (4, 2), (8, 1), (2, 4)):
            spec = P(*["tp" if (d in tp_dims and tp > 1) else None for d in range(len(shape))])
            want = _axis_dim(jp.zero_spec(spec, shape, (dp, tp)), "dp")
            dims = tuple(d for d in tp_dims if tp > 1)
            assert jr.zero_dim(shape, dims, dp, tp) == want, (shape, tp_dims, dp, tp)


def test_planned_reads_the_records() -> None:
    act = Collective("all_reduce", "tp", 1000.0, 2, "forward", "row-parallel")
    send = Collective("p2p", "pp", 10.0, 4, "forward", "activation to stage 1")
    got = fid.planned(_stage(0, colls=(act, send)))
    assert got == {
        "all-reduce@tp": {"ops": 2, "bytes": 2000.0, "why": ["row-parallel"]},
        "p2p@pp": {"ops": 4, "bytes": 40.0, "why": ["activation to stage 1"]},
    }


def test_compare_reports_ops_and_bytes() -> None:
    pred = {"all-reduce@dp": {"ops": 1, "bytes": 100.0, "why": []}}
    assert fid.compare({"all-reduce@dp": {"ops": 1, "bytes": 100.0}}, pred) == []
    assert fid.compare({"all-reduce@dp": {"ops": 2, "bytes": 100.0}}, pred) == [
        "all-reduce@dp: measured 2 ops / 100 B, predicted 1 ops / 100 B"
    ]
    assert len(fid.compare({"all-gather@tp": {"ops": 1, "bytes": 8.0}}, pred)) == 2
