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
    assert parse_cluster("16xA100", gpus_per_node=4).groups[0].num_nodes == 4
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
        ("nodez: []", "unknown fields"),
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
