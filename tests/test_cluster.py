"""Cluster specs: shorthand, presets, files, validation messages."""

import json

import pytest

from partita.cluster import CLUSTER_PRESETS, parse_cluster
from partita.errors import ClusterSpecError


def test_shorthand_mixed() -> None:
    c = parse_cluster("16xA100-80G+8xV100-32G")
    assert c.num_devices == 24
    assert [(g.device.name, g.num_nodes, g.gpus_per_node) for g in c.groups] == [("A100-80G", 2, 8), ("V100-32G", 1, 8)]
    assert c.ranks()[16] == (16, "V100-32G", 2)
    assert c.fingerprint() == parse_cluster("16xA100-80G+8xV100-32G").fingerprint()
    assert c.fingerprint() != parse_cluster("16xA100-80G+8xV100-16G").fingerprint()


def test_gpus_per_node_and_cpu() -> None:
    assert parse_cluster("16xA100-80G", gpus_per_node=4).groups[0].num_nodes == 4
    cpu = parse_cluster("4xCPU")
    assert cpu.groups[0].device.kind == "cpu" and cpu.groups[0].num_nodes == 1


def test_presets_parse() -> None:
    for name in CLUSTER_PRESETS:
        assert parse_cluster(name).num_devices > 0


def test_yaml_file(tmp_path) -> None:
    p = tmp_path / "lab.yaml"
    p.write_text(
        "name: lab\nnetwork: {nic_gbps: 400}\nnodes:\n  - {device: A100-80G, num_nodes: 2}\n"
        "  - {device: MyGPU, num_nodes: 1, gpus_per_node: 4}\n"
        "device_types:\n  - {name: MyGPU, peak_tflops: {bf16: 100}, memory_GB: 48, hbm_GBps: 900}\n"
    )
    c = parse_cluster(str(p))
    assert c.num_devices == 20 and c.network.nic_bandwidth == 400e9 / 8
    assert c.groups[1].device.memory_bytes == 48e9


@pytest.mark.parametrize(
    "spec, match",
    [
        ("16xB200", "unknown device type 'B200'"),
        ("0xA100", "must be positive"),
        ("A100", "cannot read cluster term"),
        ("12xA100-80G", "does not split into nodes of 8"),
        ("8xA100", r"'A100' in '8xA100' names 2 device types \(A100-80G, A100-40G\).*8xA100-80G or 8xA100-40G"),
        ("16xA100-80G+8xV100", r"names 2 device types \(V100-32G, V100-16G\)"),
    ],
)
def test_shorthand_errors(spec: str, match: str) -> None:
    with pytest.raises(ClusterSpecError, match=match) as e:
        parse_cluster(spec)
    assert "Fix:" in str(e.value)


@pytest.mark.parametrize(
    "text, match",
    [
        ("nodes: [ {device: A100", "not valid YAML"),
        ("nodes: []", "no 'nodes' list"),
        ("nodes:\n  - {device: A100, num_nodes: -1}", "'num_nodes' is -1, must be > 0"),
        ("nodes:\n  - {device: A100}\nnetwork: {nic_gbps: 0}", "'nic_gbps' is 0"),
        ("nodes:\n  - {num_nodes: 1}", "needs a 'device'"),
        ("nodez: []", "unknown field .nodez.; did you mean .nodes."),
    ],
)
def test_file_errors(tmp_path, text: str, match: str) -> None:
    p = tmp_path / "bad.yaml"
    p.write_text(text)
    with pytest.raises(ClusterSpecError, match=match):
        parse_cluster(str(p))


def test_json_file_and_missing(tmp_path) -> None:
    p = tmp_path / "c.json"
    p.write_text(json.dumps({"nodes": [{"device": "L4", "num_nodes": 1}]}))
    assert parse_cluster(str(p)).num_devices == 8
    with pytest.raises(ClusterSpecError, match="does not exist"):
        parse_cluster(str(tmp_path / "nope.yaml"))


# ---- reference nodes, per-group networks, shipped calibration (issue 18) ----------------------
@pytest.mark.parametrize(
    "spec, nics, gbps",
    [("64xH100-80G", 8, 400), ("16xH200", 8, 400), ("16xA100-80G", 8, 200), ("8xA100-40G", 8, 200)]
    + [("16xV100-32G", 4, 100), ("8xL4", 1, 100), ("8xT4", 1, 100)],
)
def test_shorthand_gets_the_reference_node_network(spec: str, nics: int, gbps: float) -> None:
    c = parse_cluster(spec)
    net = c.groups[0].network
    assert (net.num_nics, net.nic_bandwidth) == (nics, nics * gbps * 1e9 / 8)
    assert c.network == net and c.network_for(c.groups[0].device.name) == net
    assert f"{gbps:g} Gb/s" in c.describe_network()


def test_dgx_h100_dp_ring_gets_one_nic_per_gpu() -> None:
    from partita.search.pricing.mesh import LogicalMesh

    c = parse_cluster("64xH100-80G")
    dev = c.groups[0].device
    link = LogicalMesh((8, 8), ("dp", "tp"), dev, 8, c.network_for(dev.name)).link(0)
    assert link.crosses_nodes and link.bandwidth == pytest.approx(400e9 / 8)  # 8 rings share 8 x 400 Gb/s


def test_mixed_cluster_networks_and_default_link_is_the_slower_side() -> None:
    c = parse_cluster("16xA100-80G+16xV100-32G+8xL4")
    a100, v100, l4 = (c.network_for(n) for n in ("A100-80G", "V100-32G", "L4"))
    assert a100.nic_bandwidth == 200e9 and v100.nic_bandwidth == 50e9 and l4.nic_bandwidth == 12.5e9
    assert c.link_between(0, 1) == v100 and c.link_between(0, 2).nic_bandwidth == 12.5e9
    assert c.network.nic_bandwidth == 12.5e9  # the cluster-wide view is the slowest group
    assert c.network_among(["A100-80G", "V100-32G"]).nic_bandwidth == 50e9


def test_file_overrides_per_group_and_declares_group_links(tmp_path) -> None:
    p = tmp_path / "lab.yaml"
    p.write_text(
        "nodes:\n"
        "  - {device: A100-80G, num_nodes: 2, network: {num_nics: 4}}\n"
        "  - {device: V100-32G, num_nodes: 2}\n"
        "links:\n  - {between: [A100-80G, 1], nic_gbps: 25, latency_us: 20}\n"
    )
    c = parse_cluster(str(p))
    assert c.group_network(0).nic_bandwidth == 4 * 200e9 / 8  # the preset's NIC speed, 4 of them
    assert c.group_network(1).nic_bandwidth == 4 * 100e9 / 8  # DGX-1 preset
    link = c.link_between(1, 0)
    assert link.nic_bandwidth == 4 * 25e9 / 8 and link.latency == pytest.approx(20e-6)  # num_nics from the slower side
    assert c.network_among(["A100-80G", "V100-32G"]) == link
    assert "group 0<->1" in c.describe_network() and c.to_dict()["links"][0]["between"] == [0, 1]


@pytest.mark.parametrize(
    "text, match",
    [
        ("nodes:\n  - {device: A100}\nlinks:\n  - {between: [0, 3]}", "names no single node group"),
        ("nodes:\n  - {device: A100}\n  - {device: L4}\nlinks:\n  - {between: [0, 0]}", "to itself"),
        ("nodes:\n  - {device: A100, network: {nic_gbs: 5}}", "unknown field .nic_gbs.; did you mean .nic_gbps."),
        ("nodes:\n  - {device: A100, network: {num_nics: 1.5}}", "not a whole number"),
    ],
)
def test_network_file_errors(tmp_path, text: str, match: str) -> None:
    p = tmp_path / "bad.yaml"
    p.write_text(text)
    with pytest.raises(ClusterSpecError, match=match):
        parse_cluster(str(p))


def test_shipped_a100_calibration_is_applied_by_default_and_can_be_turned_off(tmp_path, monkeypatch) -> None:
    from partita.search.pricing.cost_model import CostModel, Efficiency

    on = parse_cluster("16xA100-80G")
    dev = on.groups[0].device
    assert dev.profile == "partita:a100_megatron_calibration.json" and dev.profile_hash
    assert on.to_dict()["groups"][0]["calibration"] == dev.profile
    assert CostModel.for_device(dev).efficiency != Efficiency()  # the fitted factors, not the defaults
    assert parse_cluster("8xA100-40G").groups[0].device.profile == dev.profile  # same chip, applies_to
    assert parse_cluster("8xV100-32G").groups[0].device.profile == ""  # no shipped profile
    assert parse_cluster("8xH100-80G").groups[0].device.profile == "partita:h100_calibration.json"  # its own
    off = parse_cluster("16xA100-80G", calibrated=False)
    assert off.groups[0].device.profile == "" and off.fingerprint() != on.fingerprint()
    assert CostModel.for_device(off.groups[0].device).efficiency == Efficiency()
    monkeypatch.setenv("PARTITA_CALIBRATION", "off")
    assert parse_cluster("16xA100-80G").fingerprint() == off.fingerprint()
    monkeypatch.delenv("PARTITA_CALIBRATION")
    p = tmp_path / "c.yaml"
    p.write_text("nodes:\n  - {device: A100-80G, profile: none}\n  - {device: A100-80G}\n")
    c = parse_cluster(str(p))
    assert c.groups[0].device.profile == "" and c.groups[1].device.profile == dev.profile
