"""Cost model numbers against hand-computed formula values, and calibration-profile validation."""

from __future__ import annotations

import pytest

from partita.cluster import DEVICE_PRESETS, Network
from partita.ir import Prim
from partita.search.pricing.cost_model import CostModel, Efficiency, ProfileError, state_bytes_per_param
from partita.search.pricing.mesh import LogicalMesh

A100 = DEVICE_PRESETS["A100-80G"]


def test_a100_gemm_8192_matches_roofline_formula() -> None:
    cm = CostModel(A100)
    flops = 2 * 8192**3
    nbytes = 3 * 8192 * 8192 * 2
    eff = 0.75 * flops / (flops + 2e9)
    expected = max(flops / (312e12 * eff), nbytes / (2.039e12 * 0.8)) + 5e-6
    assert cm.compute_time(Prim.MATMUL, flops, nbytes, "bf16") == pytest.approx(expected, rel=1e-12)
    assert expected == pytest.approx(4.712e-3, rel=1e-3)  # 1.1 TFLOP at ~234 TFLOP/s


def test_small_gemm_is_less_efficient_and_memory_bound_ops_use_hbm() -> None:
    cm = CostModel(A100)
    big, small = 2 * 8192**3, 2 * 256**3
    assert cm.efficiency.matmul_efficiency(small) < 0.5 * cm.efficiency.matmul_efficiency(big)
    t = cm.compute_time(Prim.ELEMENTWISE, 1e6, 1e9, "bf16")
    assert t == pytest.approx(1e9 / (2.039e12 * 0.8) + 5e-6)


def test_nvlink_all_reduce_1gib_on_8_gpus() -> None:
    mesh = LogicalMesh((8,), ("tp",), A100, 8)
    link = mesh.link(0)
    assert not link.crosses_nodes and link.bandwidth == 600e9
    s = 2**30
    expected = 2 * 7 / 8 * s / (600e9 * 0.4) + 2 * 7 * 2e-6 + 10e-6
    assert CostModel(A100).collective_time("all_reduce", s, link) == pytest.approx(expected, rel=1e-12)
    ag = (7 / 8) * s / (600e9 * 0.4) + 7 * 2e-6 + 10e-6
    assert CostModel(A100).collective_time("all_gather", s, link) == pytest.approx(ag, rel=1e-12)


def test_inter_node_axis_shares_the_nic() -> None:
    net = Network(nic_bandwidth=100e9, latency=5e-6)
    mesh = LogicalMesh((4, 8), ("dp", "tp"), A100, 8, net)
    assert mesh.is_intra_node(1) and not mesh.is_intra_node(0)
    assert mesh.link(0).bandwidth == pytest.approx(100e9 / 8) and mesh.link(0).latency == 5e-6
    mesh2 = LogicalMesh((16, 2), ("dp", "tp"), A100, 8, net)  # 4 members of each dp group per node
    assert mesh2.link(0).bandwidth == pytest.approx(100e9 / 2)


def test_state_bytes() -> None:
    assert state_bytes_per_param("bf16", "adam") == (2, 2, 12)
    assert state_bytes_per_param("bf16", "sgd") == (2, 2, 4)
    assert state_bytes_per_param("f32", "adam") == (4, 4, 8)


def test_profile_roundtrip_and_validation(tmp_path) -> None:
    eff = Efficiency(matmul=0.6, device="A100-80G")
    path = tmp_path / "p.json"
    import json

    path.write_text(json.dumps(eff.to_profile()))
    assert Efficiency.from_profile(path, "A100-80G") == eff
    with pytest.raises(ProfileError, match="measured on A100-80G"):
        Efficiency.from_profile(path, "H100-80G")
    bad = eff.to_profile() | {"version": 99}
    with pytest.raises(ProfileError, match="version"):
        Efficiency.from_profile(bad)
    with pytest.raises(ProfileError, match="unknown"):
        Efficiency.from_profile(eff.to_profile() | {"efficiency": {"matmull": 0.5}})
    with pytest.raises(ProfileError, match=r"\(0, 1\]"):
        Efficiency.from_profile(eff.to_profile() | {"efficiency": {"matmul": 1.5}})
    with pytest.raises(ProfileError, match="does not exist"):
        Efficiency.from_profile(tmp_path / "missing.json")
