"""GEMM efficiency by shape (search/pricing/gemm.py): wave and tile quantization against hand counts."""

from __future__ import annotations

import json

import pytest

from partita.cluster import DEVICE_PRESETS
from partita.ir import DimSig, Prim
from partita.search.pricing import gemm
from partita.search.pricing.cost_model import CostModel

A100, H100, CPU = DEVICE_PRESETS["A100-80G"], DEVICE_PRESETS["H100-80G"], DEVICE_PRESETS["CPU"]


def test_every_shipped_gpu_type_has_an_sm_count_with_a_source() -> None:
    table = json.loads(gemm._DATA.read_text())
    gpus = [name for name, d in DEVICE_PRESETS.items() if d.kind == "gpu"]
    assert sorted(table["sms"]) == sorted(gpus)
    assert all(table["sources"].get(name) for name in gpus)
    assert gemm.sm_count("A100-40G") == 108 and gemm.sm_count("H100-80G") == 132 and gemm.sm_count("CPU") is None


def test_one_full_wave_on_a100_leaves_a_fifth_of_h100_idle() -> None:
    # 2304 x 1536 in 256 x 128 tiles: 9 x 12 = 108 tiles, one per A100 SM. k = 256 is too short to split.
    assert gemm.shape_efficiency(108, 1, 2304, 1536, 256) == 1.0
    # On 132 SMs every tiling of that shape leaves SMs idle: 108 blocks of 132 (256x128, 128x256) or 216 of
    # 264 (128x128, two waves) is the best, 108 / 132.
    assert gemm.shape_efficiency(132, 1, 2304, 1536, 256) == pytest.approx(108 / 132)


def test_one_row_more_costs_a_partial_tile_and_a_partial_wave() -> None:
    # m = 2305: 128 x 128 tiles are best (hand count over the 8 tilings): 19 x 12 = 228 blocks in 3 waves of 108,
    # each tile column holding 2305 of 2432 rows.
    got = gemm.shape_efficiency(108, 1, 2305, 1536, 256)
    assert got == pytest.approx(2305 / 2432 * 228 / 324)
    assert got < 0.7 * gemm.shape_efficiency(108, 1, 2304, 1536, 256)


def test_split_k_fills_the_device_when_k_is_long() -> None:
    # 256 x 128 output: best in 64 x 64 tiles (8 blocks at half the plateau's intensity, 4 / 108 of the device);
    # k = 8192 also splits in 4 (k / 4 >= 512): 32 blocks, 16 / 108.
    assert gemm.shape_efficiency(108, 1, 256, 128, 256) == pytest.approx(8 * 0.5 / 108)
    assert gemm.shape_efficiency(108, 1, 256, 128, 8192) == pytest.approx(32 * 0.5 / 108)


def test_local_shape_divides_the_sharded_labels() -> None:
    linear = DimSig.parse("bsk,nk->bsn")  # x W^T, output columns sharded on tp, batch on dp
    sizes = {"b": 8, "s": 2048, "k": 4096, "n": 12288}
    assert gemm.local_shape(linear, sizes, ("b", "n"), (4, 8)) == (1, 2 * 2048, 12288 // 8, 4096)
    assert gemm.local_shape(linear, sizes, ("", "k"), (1, 8)) == (1, 8 * 2048, 12288, 512)
    scores = DimSig.parse("bhsd,bhtd->bhst")  # attention's Q K^T: batch and heads are batch dims
    sizes = {"b": 2, "h": 32, "s": 2048, "t": 2048, "d": 128}
    assert gemm.local_shape(scores, sizes, ("h",), (8,)) == (2 * 4, 2048, 2048, 128)
    assert gemm.local_shape(DimSig.parse("ab->ab"), {"a": 2, "b": 2}, (), ()) is None


def test_cost_model_prices_a_shaped_matmul_at_the_plateau_times_the_shape() -> None:
    cm = CostModel(A100)
    shape = (1, 2305, 1536, 256)
    flops, nbytes = 2.0 * 2305 * 1536 * 256, 0.0
    e = cm.efficiency.matmul * gemm.shape_efficiency(108, *shape)
    assert cm.compute_time(Prim.MATMUL, flops, nbytes, "bf16", shape) == pytest.approx(
        flops / (312e12 * e) + cm.efficiency.kernel_overhead_s, rel=1e-12
    )
    # without a shape (or on a device type without an SM count) the FLOP curve prices it, as before
    curve = flops / (312e12 * cm.efficiency.matmul_efficiency(flops)) + cm.efficiency.kernel_overhead_s
    assert cm.compute_time(Prim.MATMUL, flops, nbytes, "bf16") == pytest.approx(curve, rel=1e-12)
    cpu = CostModel.for_device(CPU)
    assert cpu.compute_time(Prim.MATMUL, flops, nbytes, "f32", shape) == cpu.compute_time(
        Prim.MATMUL, flops, nbytes, "f32"
    )


def test_backward_is_its_two_gemms() -> None:
    cm = CostModel(H100)
    shape = (1, 4096, 768, 6144)  # a tp-8 column of a 6144-wide block: dA is 4096 x 6144 (k = 768), dB 6144 x 768
    flops, nbytes = 2.0 * 4096 * 768 * 6144, 3e7
    want = cm.compute_time(Prim.MATMUL, flops, nbytes, "bf16", (1, 4096, 6144, 768)) + cm.compute_time(
        Prim.MATMUL, flops, nbytes, "bf16", (1, 6144, 768, 4096)
    )
    assert cm.backward_compute_time(Prim.MATMUL, flops, nbytes, "bf16", shape) == pytest.approx(want, rel=1e-12)
    assert cm.backward_compute_time(Prim.MATMUL, flops, nbytes, "bf16") == cm.compute_time(
        Prim.MATMUL, 2 * flops, 2 * nbytes, "bf16"
    )
