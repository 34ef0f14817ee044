"""The profiler: fits recover known parameters (micro-benchmarks, step probes, Adam grid), profiles
round-trip and are validated on load (also through a cluster file's ``profile:``), a cluster file
naming a profile prices exactly like the calibrated device, the plan's cluster fingerprint tracks
the profile's content, and real short runs (1 rank, then 2 gloo ranks) produce profiles the cost
model loads."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest

from partita.cluster import DEVICE_PRESETS, parse_cluster, parse_shorthand
from partita.ir import Prim
from partita.profile.profiler import (
    build_profile,
    calibrated_cluster,
    calibrated_device,
    collective_factors,
    cuda_device_type,
    fit_gemm,
    fit_link,
    load_profile,
    micro_profile,
    profile,
    profile_fingerprint,
)
from partita.profile.step_probe import ADAM_STATE_BYTES, fit_optimizer, fit_step
from partita.search.pricing.cost_model import CostModel, Efficiency, ProfileError
from partita.search.pricing.mesh import AxisLink

pytestmark = pytest.mark.serial  # profiles within a time budget: scripts/test.sh runs this file alone

CPU = DEVICE_PRESETS["CPU"]


def test_fit_gemm_recovers_the_saturating_curve() -> None:
    peak, half, k = 40e9, 3e6, 4e-6
    rows = [
        {"dtype": "f32", "flops": f, "median_s": (f + half) / peak + k} for f in (2e4, 5e5, 4e6, 3e7, 2e8, 2e9, 1e10)
    ]
    fit = fit_gemm(rows, "f32", k)
    assert fit is not None
    assert fit["saturated_flops"] == pytest.approx(peak, rel=0.03)
    assert fit["half_flops"] == pytest.approx(half, rel=0.15)
    assert fit_gemm(rows, "bf16", k) is None  # no points of that dtype


def test_fit_link_separates_alpha_beta_and_fixed_latency() -> None:
    bw, alpha, c = 1.5e9, 40e-6, 300e-6
    rows = []
    for kind, p in (("all_reduce", 2), ("all_reduce", 4), ("all_gather", 4), ("all_to_all", 4)):
        m, h = collective_factors(kind, p)
        for s in (4096.0, 65536.0, 1 << 20, 1 << 24):
            rows.append({"kind": kind, "group_size": p, "bytes": s, "median_s": m * s / bw + h * alpha + c})
    fit = fit_link(rows, ("all_reduce", "all_gather", "all_to_all"))
    assert fit is not None
    assert fit["bandwidth_Bps"] == pytest.approx(bw, rel=1e-3)
    assert fit["alpha_s"] == pytest.approx(alpha, rel=1e-2)
    assert fit["fixed_latency_s"] == pytest.approx(c, rel=1e-2)


def _synthetic_profile() -> dict:
    gemm = [{"dtype": d, "flops": f, "median_s": (f + 1e6) / p + 3e-6} for d, p in (("f32", 60e9), ("bf16", 120e9))
            for f in (1e5, 1e7, 1e9, 1e10)]  # fmt: skip
    colls = []
    for p in (2, 4):
        m, h = collective_factors("all_reduce", p)
        colls += [{"kind": "all_reduce", "group_size": p, "bytes": s, "median_s": m * s / 1e9 + h * 1e-4 + 2e-4}
                  for s in (4096.0, 1e6, 1.6e7)]  # fmt: skip
    tables = {
        "gemm": gemm,
        "attention": [{"dtype": "f32", "flops": 1e9, "median_s": 0.1}],
        "memory": [{"op": "copy", "bytes": 6.4e7, "median_s": 0.01}],
        "overhead": {"eager_op_s": 3e-6, "autograd_op_s": 2e-5},
        "collectives": colls,
        "p2p": [],
    }
    host = {"device_type": "CPU", "device_kind": "cpu", "torch": "x", "cpu_model": "test"}
    return build_profile(tables, host, {"nproc": 4})


def test_build_profile_maps_fits_to_efficiency_and_overrides(tmp_path: Path) -> None:
    prof = _synthetic_profile()
    eff = Efficiency.from_profile(prof, "CPU")
    assert eff.matmul == 1.0  # 60 GFLOP/s beats the preset's 20: capped, absolute peak in overrides
    assert prof["device_overrides"]["peak_flops"]["f32"] == pytest.approx(60e9, rel=0.05)
    assert eff.memory == pytest.approx(6.4e9 / CPU.hbm_bandwidth)
    assert eff.kernel_overhead_s == 2e-5
    assert eff.collective_bandwidth == pytest.approx(1e9 / CPU.intra_node_bandwidth, rel=1e-3)
    assert eff.collective_latency_s == pytest.approx(2e-4, rel=1e-2)
    path = tmp_path / "p.json"
    path.write_text(json.dumps(prof))
    dev = calibrated_device(CPU, path)
    assert dev.intra_node_latency == pytest.approx(1e-4, rel=1e-2)
    cm = CostModel.for_device(dev)
    # a big f32 GEMM priced by the calibrated model matches the synthetic measurement
    f = 1e10
    assert cm.compute_time(Prim.MATMUL, f, 0.0, "f32") == pytest.approx((f + 1e6) / 60e9 + 2e-5, rel=0.05)
    link = AxisLink("dp", 4, dev.intra_node_bandwidth, dev.intra_node_latency, False)
    m, h = collective_factors("all_reduce", 4)
    assert cm.collective_time("all_reduce", 1.6e7, link) == pytest.approx(m * 1.6e7 / 1e9 + h * 1e-4 + 2e-4, rel=0.01)


def test_validation_on_load(tmp_path: Path) -> None:
    good = _synthetic_profile()
    path = tmp_path / "p.json"
    for change, call in (
        ({"device": "H100-80G"}, lambda p: load_profile(p, "CPU")),
        ({"version": 99}, lambda p: load_profile(p)),
        ({"profiler_version": 7}, lambda p: load_profile(p)),
        ({"device_overrides": {"hbm": 1.0}}, lambda p: load_profile(p)),
        ({"device_overrides": {"hbm_bandwidth": "fast"}}, lambda p: load_profile(p)),
        ({"host": {"device_kind": "gpu"}}, lambda p: load_profile(p, CPU)),
        ({"device": "H100-80G"}, lambda p: calibrated_device(CPU, p)),
    ):
        path.write_text(json.dumps(good | change))
        with pytest.raises(ProfileError):
            call(path)
    path.write_text(json.dumps(good))
    assert load_profile(path, CPU)["device"] == "CPU"
    with pytest.raises(ProfileError):  # a cluster without the profile's device type
        calibrated_cluster(parse_shorthand("8xA100-80G"), path)
    with pytest.raises(ProfileError):
        load_profile(tmp_path / "missing.json")


def test_fingerprint_follows_content_not_path(tmp_path: Path) -> None:
    prof = _synthetic_profile()
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(prof))
    b.write_text(json.dumps(prof | {"tables": {}, "setup": {"nproc": 2}}))
    assert profile_fingerprint(a) == profile_fingerprint(b)  # raw tables do not change planning
    changed = prof | {"efficiency": prof["efficiency"] | {"memory": 0.5}}
    b.write_text(json.dumps(changed))
    assert profile_fingerprint(a) != profile_fingerprint(b)
    # the cluster fingerprint (and so the compile cache key) changes with the profile path
    c0 = parse_shorthand("4xCPU")
    c1 = calibrated_cluster(c0, a)
    assert c0.fingerprint() != c1.fingerprint()


def test_cuda_names_map_to_presets() -> None:
    assert cuda_device_type("NVIDIA H100 80GB HBM3", 85e9) == "H100-80G"
    assert cuda_device_type("NVIDIA A100-SXM4-40GB", 42e9) == "A100-40G"
    assert cuda_device_type("NVIDIA A100-SXM4-80GB", 85e9) == "A100-80G"
    assert cuda_device_type("NVIDIA L4", 24e9) == "L4"


def test_one_rank_profile_round_trips(tmp_path: Path) -> None:
    out = tmp_path / "cpu.json"
    prof = profile("cpu", nproc=1, out=str(out), time_budget_s=3, progress=False)
    assert prof["setup"]["elapsed_s"] < 3 + 10
    disk = json.loads(out.read_text())
    assert disk == json.loads(json.dumps(prof))
    eff = Efficiency.from_profile(out, "CPU")
    assert dataclasses.asdict(eff) | {"device": ""} == {**dataclasses.asdict(Efficiency()), **disk["efficiency"]}
    assert disk["host"]["torch"].startswith("2.") and disk["host"]["device_type"] == "CPU"
    assert len(disk["tables"]["gemm"]) >= 4 and disk["tables"]["memory"]
    assert all(math.isfinite(r["median_s"]) and r["median_s"] > 0 for r in disk["tables"]["gemm"])
    # rebuilding from the raw tables gives the same profile (the fit is a pure function of them)
    again = build_profile(disk["tables"], disk["host"], disk["setup"])
    assert again["efficiency"] == disk["efficiency"]
    dev = calibrated_device(CPU, out)
    assert dev.peak_flops["f32"] * eff.matmul == pytest.approx(disk["fit"]["gemm"]["f32"]["saturated_flops"])


@pytest.mark.multiprocess
def test_two_gloo_ranks_fit_alpha_beta(tmp_path: Path) -> None:
    out = tmp_path / "cpu2.json"
    prof = profile("cpu", nproc=2, out=str(out), time_budget_s=14, progress=False)
    kinds = {r["kind"] for r in prof["tables"]["collectives"]}
    assert kinds == {"all_reduce", "all_gather", "reduce_scatter", "all_to_all"}
    assert prof["tables"]["p2p"] and prof["setup"]["backend"] == "gloo"
    link = prof["links"]["intra_node"]
    assert link["bandwidth_Bps"] > 1e6 and link["alpha_s"] >= 0 and link["fixed_latency_s"] >= 0
    eff = Efficiency.from_profile(out, "CPU")
    assert 0 < eff.collective_bandwidth <= 1
    assert calibrated_device(CPU, out).intra_node_bandwidth * eff.collective_bandwidth == pytest.approx(
        link["bandwidth_Bps"]
    )


def _with_probes(prof: dict, share: float, k: float, c: float, d: float, overlap: float) -> dict:
    """``prof``'s tables plus synthetic step probes, Adam grid and overlap probe with known answers."""
    tables = dict(prof["tables"])
    terms = [(2e-4, 100.0, 16, 2e4), (4e-3, 150.0, 28, 2.5e5), (3e-2, 150.0, 28, 1e6)]
    tables["step_probe"] = [
        {"name": f"p{i}", "fb_s": a / share + n * k, "opt_s": nt * c + ADAM_STATE_BYTES * ne * d,
         "num_tensors": nt, "numel": ne, "terms": {"roofline_s": a, "kernels": n}}
        for i, (a, n, nt, ne) in enumerate(terms)
    ]  # fmt: skip
    tables["optimizer"] = [
        {"num_tensors": nt, "numel": ne, "median_s": nt * c + ADAM_STATE_BYTES * ne * d}
        for nt, ne in ((64, 65536), (4, 1 << 20))
    ]
    tables["overlap"] = {"compute_s": 1e-2, "comm_s": 1e-2, "both_s": 2e-2 - overlap * 1e-2, "overlap": overlap}
    return build_profile(tables, prof["host"], prof["setup"])


def test_step_and_optimizer_fits_recover_known_parameters(tmp_path: Path) -> None:
    base = _synthetic_profile()
    share, k, c, d = 0.5, 1.2e-5, 2e-5, 3e-10
    prof = _with_probes(base, share, k, c, d, overlap=0.25)
    eff, eff0 = prof["efficiency"], base["efficiency"]
    assert prof["fit"]["step"]["sustained_share"] == pytest.approx(share, rel=1e-6)
    assert eff["kernel_overhead_s"] == pytest.approx(k, rel=1e-6)
    for name in ("matmul", "attention", "memory"):  # the in-step rate is half the micro-benchmarks'
        assert eff[name] == pytest.approx(eff0[name] * share, rel=1e-6)
    assert eff["optimizer_tensor_s"] == pytest.approx(c, rel=1e-6)
    hbm = prof["device_overrides"]["hbm_bandwidth"]
    assert eff["optimizer_memory"] == pytest.approx(2.0 / (hbm * d), rel=1e-6)
    assert eff["comm_overlap"] == pytest.approx(0.25)
    assert micro_profile(prof["tables"], prof["host"], {})["efficiency"] == eff0  # the probes' pricing basis
    # faster than the micro-benchmarks: factors stay <= 1, the absolute peaks rise instead
    fast = _with_probes(base, 3.0, k, c, d, overlap=1.0)
    assert max(fast["efficiency"][n] for n in ("matmul", "attention", "memory")) == pytest.approx(1.0)
    p0, p1 = base["device_overrides"]["peak_flops"]["f32"], fast["device_overrides"]["peak_flops"]["f32"]
    assert p1 * fast["efficiency"]["matmul"] == pytest.approx(p0 * eff0["matmul"] * 3.0, rel=1e-6)
    assert Efficiency.from_profile(fast, "CPU").comm_overlap == 1.0
    assert fit_step(prof["tables"]["step_probe"][:1]) is None and fit_optimizer([], 1e9, 2.0) is None


def test_cluster_file_profile_prices_like_the_calibrated_device(tmp_path: Path) -> None:
    """``profile:`` in a cluster file applies the overrides too (the old path applied only the
    efficiency block), the plan's cluster fingerprint follows the profile's content, and a profile
    of another device type, kind or format version is refused with a clear error."""
    from partita.search.pipeline.stage_cost import SolverCosts

    prof = _with_probes(_synthetic_profile(), 0.5, 1.2e-5, 2e-5, 3e-10, overlap=0.0)
    path = tmp_path / "p.json"
    path.write_text(json.dumps(prof))
    yaml_path = tmp_path / "c.yaml"
    yaml_path.write_text(f"nodes: [{{device: CPU, gpus_per_node: 2, profile: {path}}}]\n")
    dev = parse_cluster(str(yaml_path)).device_types()[0]
    assert dev == calibrated_device(CPU, path)
    assert dev.peak_flops["f32"] == prof["device_overrides"]["peak_flops"]["f32"] != CPU.peak_flops["f32"]
    assert dev.profile_hash == profile_fingerprint(path)
    cm = CostModel.for_device(dev)
    assert cm == CostModel.for_device(dataclasses.replace(CPU, profile=str(path)))  # hand-built device too
    assert cm.efficiency.optimizer_tensor_s == pytest.approx(2e-5) and cm.efficiency.comm_overlap == 0.0
    fp0 = parse_cluster(str(yaml_path)).fingerprint()
    path.write_text(json.dumps(prof | {"efficiency": prof["efficiency"] | {"kernel_overhead_s": 1e-4}}))
    assert parse_cluster(str(yaml_path)).fingerprint() != fp0  # efficiency only: same overrides, new hash
    for change, words in (
        ({"device": "H100-80G"}, "measured on H100-80G"),
        ({"version": 99}, "version 99"),
        ({"host": {"device_kind": "gpu"}}, "gpu device"),
        ({"device_overrides": {"peak_flops": {"f32": 0}}}, "positive"),
    ):
        path.write_text(json.dumps(prof | change))
        with pytest.raises(ProfileError, match=words):
            parse_cluster(str(yaml_path))
    # the stage formulas see the profile's optimizer and overlap terms; defaults leave GPUs unchanged
    from partita.frontends.trace import trace_handle
    from partita.models import resolve_model
    from partita.search.pricing.config import TrainingConfig

    path.write_text(json.dumps(prof))
    graph = trace_handle(resolve_model("gpt2-tiny"), batch=2, seq=16)
    training = TrainingConfig(global_batch=2, seq_len=16, dtype="f32")
    costs = SolverCosts(graph, parse_cluster(str(yaml_path)), training)
    cost, _ = costs.layer(1, dev, 1, 2)
    assert cost.optimizer_fixed_s == pytest.approx(2e-5 * len(graph.layers[1].params))
    assert cost.comm_overlap == 0.0
    gpu = SolverCosts(graph, parse_shorthand("8xA100-80G"), training).layer(1, DEVICE_PRESETS["A100-80G"], 1, 2)[0]
    assert (gpu.optimizer_fixed_s, gpu.optimizer_stream_scale, gpu.comm_overlap) == (0.0, 1.0, 1.0)
