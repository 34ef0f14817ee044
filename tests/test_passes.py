"""IR passes: cost annotation, layer grouping, the pass pipeline and the verifier."""

from __future__ import annotations

import dataclasses
import functools
import os

import pytest
import sympy

from partita import prims
from partita.errors import IRError
from partita.frontends.trace_torch import trace_module
from partita.ir import Graph, GraphBuilder, Prim, Role
from partita.models import resolve_model
from partita.passes.annotate import annotate, layer_stats
from partita.passes.layers import group_layers
from partita.passes.pipeline import PassOptions, dce, run_passes

B, S = sympy.Symbol("B"), sympy.Symbol("S")
GOLDEN = os.path.join(os.path.dirname(__file__), "golden", "gpt2_tiny.txt")


@functools.cache
def _zoo_graph(name: str) -> Graph:
    h = resolve_model(name)
    seq = 16 if h.config.get("tokens") else 0
    return trace_module(h.build(), h.example_inputs(2, seq), name=name, dynamic=h.dynamic())


def _gpt_reference(name: str, b: int, s: int) -> tuple[int, int]:
    """2*b*s*P_matmul + 4*b*s^2*h*l (P_matmul: 2-D weights incl. the tied lm head, not positions)."""
    h = resolve_model(name)
    m = h.build()
    p_mm = sum(p.numel() for n, p in m.named_parameters() if p.dim() == 2 and "wpe" not in n)
    c = h.config
    return 2 * b * s * p_mm + 4 * b * s * s * c["hidden"] * c["num_layers"], c["num_layers"]


def test_matmul_attention_conv_rules() -> None:
    gb = GraphBuilder("t")
    x = gb.tensor("x", (B, S, 64), "f32", Role.INPUT)
    w = gb.tensor("w", (128, 64), "f32", Role.PARAMETER, "w")
    (y,) = gb.add(Prim.MATMUL, [x, w], [("y", (B, S, 128), "f32")], prims.linear(3))
    q = gb.tensor("q", (B, 4, S, 16), "f32", Role.INPUT)
    qs = (B, 4, S, 16)
    (o,) = gb.add(Prim.ATTENTION, [q, q, q], [("o", qs, "f32")], prims.attention(qs, qs, qs))
    img = gb.tensor("img", (B, 3, 32, 32), "f32", Role.INPUT)
    k = gb.tensor("k", (8, 3, 3, 3), "f32", Role.PARAMETER, "k")
    (c,) = gb.add(Prim.CONV, [img, k], [("c", (B, 8, 30, 30), "f32")], prims.conv(4, False))
    (r,) = gb.add(Prim.RESHAPE, [y], [("r", (B * S, 128), "f32")], prims.reshape((B, S, 128), (B * S, 128)))
    g = annotate(gb.build())
    f = {n.outputs[0]: n for n in g.nodes}
    assert sympy.expand(f[y].flops - 2 * B * S * 64 * 128) == 0
    assert sympy.expand(f[o].flops - 4 * B * 4 * S * S * 16) == 0
    assert sympy.expand(f[c].flops - 2 * (B * 8 * 30 * 30) * 3 * 9) == 0
    assert f[r].flops == 0 and f[r].bytes_moved == 0
    assert sympy.expand(f[y].bytes_moved - 4 * (B * S * 64 + 128 * 64 + B * S * 128)) == 0


def test_gpt2_tiny_layers_and_stats() -> None:
    g = run_passes(_zoo_graph("gpt2-tiny"), PassOptions(check=True))
    names = [lay.name for lay in g.layers]
    assert names == ["embed", "transformer.h.0", "transformer.h.1", "head"]
    assert g.layers[1].kind == g.layers[2].kind != g.layers[0].kind
    assert all(n.layer for n in g.nodes)
    loss = g.producers()[g.outputs[0]]
    assert loss.layer == "head" and loss.prim is Prim.CROSS_ENTROPY
    order = [n.layer for n in g.nodes]  # each layer is one contiguous run of nodes
    assert sum(1 for a, b in zip(order, order[1:]) if a != b) == len(g.layers) - 1
    assert g.layers[1].inputs and g.layers[1].outputs and g.layers[2].inputs[0] in g.layers[1].outputs
    env = {"B": 4, "S": 32}
    stats = layer_stats(g, env)
    assert sum(s.forward_flops for s in stats) == int(g.forward_flops().subs({B: 4, S: 32}))
    assert sum(s.param_count for s in stats) == g.num_params()
    blk = stats[1]
    mm = sum(
        int(n.flops.subs({B: 4, S: 32}))
        for n in g.nodes
        if n.layer == blk.name and n.prim in (Prim.MATMUL, Prim.ATTENTION)
    )
    assert blk.backward_flops == blk.forward_flops + mm
    assert blk.boundary_bytes == 4 * 32 * 64 * 4  # one f32 [B, S, h] residual stream
    assert blk.activation_bytes > blk.boundary_bytes


def test_gpt_flops_match_formula_and_layers_repeat() -> None:
    g = run_passes(_zoo_graph("gpt3-1.3b"))
    ref, num_layers = _gpt_reference("gpt3-1.3b", 2, 2048)
    got = int(g.forward_flops().subs({B: 2, S: 2048}))
    assert abs(got - ref) / ref < 0.02, (got, ref)
    kinds = [lay.kind for lay in g.layers]
    assert len(kinds) == num_layers + 2 and len(set(kinds[1:-1])) == 1 and kinds.count(kinds[1]) == num_layers


def test_resnet_blocks_are_bottlenecks() -> None:
    g = run_passes(_zoo_graph("resnet-50"))
    blocks = [lay for lay in g.layers if lay.name not in ("embed", "head")]
    assert len(blocks) == 3 + 4 + 6 + 3
    assert len({lay.kind for lay in blocks}) == 8  # per stage: the downsampling first block + the rest


def test_golden_printer_gpt2_tiny() -> None:
    text = run_passes(_zoo_graph("gpt2-tiny")).as_text()
    if os.environ.get("UPDATE_GOLDEN"):
        with open(GOLDEN, "w") as f:
            f.write(text)
    with open(GOLDEN) as f:
        assert text == f.read(), "printer output changed; rerun with UPDATE_GOLDEN=1 if intended"


def test_json_round_trip_keeps_annotations() -> None:
    g = run_passes(_zoo_graph("llama-tiny"))
    back = Graph.from_json(g.to_json())
    assert back.hash() == g.hash() and back.forward_flops() == g.forward_flops()


def test_verifier_names_the_corrupted_node() -> None:
    g = _zoo_graph("gpt2-tiny")
    k = next(i for i, n in enumerate(g.nodes) if n.prim is Prim.MATMUL)
    bad = dataclasses.replace(g.nodes[k], inputs=(g.nodes[k].inputs[0], "no_such_tensor", *g.nodes[k].inputs[2:]))
    broken = g.replace_nodes([*g.nodes[:k], bad, *g.nodes[k + 1 :]])
    with pytest.raises(IRError, match=g.nodes[k].name):
        broken.verify()
    with pytest.raises(IRError, match=g.nodes[k].name):
        run_passes(broken, PassOptions(check=True))


def test_dce_and_skip() -> None:
    g = _zoo_graph("gpt2-tiny")
    live = dce(g)
    live.verify()
    assert len(live.nodes) <= len(g.nodes) and live.forward_flops() == g.forward_flops()
    out = run_passes(g, PassOptions(skip=("group_layers",)))
    assert not out.layers and out.forward_flops() != 0
    with pytest.raises(IRError, match="unknown pass"):
        run_passes(g, PassOptions(skip=("nope",)))


def test_group_layers_without_repeats() -> None:
    g = group_layers(annotate(_zoo_graph("mlp")))
    assert [lay.name for lay in g.layers] == ["fc1", "act", "fc2"]
    assert g.producers()[g.outputs[0]].layer == "fc2"


def test_pointwise_fusion_drops_only_private_intermediates() -> None:
    """x -> a=x*2 -> b=a+1 (a private: fused) -> softmax(b) (b private: fused into the reduction);
    b2 = b as a graph output too in the second graph, so b stays materialised there."""
    from partita.passes.fusion import fuse_pointwise

    def build(b_is_output: bool) -> Graph:
        gb = GraphBuilder("f")
        shp = (B, S, 64)
        x = gb.tensor("x", shp, "f32", Role.INPUT)
        (a,) = gb.add(Prim.ELEMENTWISE, [x], [("a", shp, "f32")], prims.elementwise(shp, [shp]))
        (b,) = gb.add(Prim.ELEMENTWISE, [a], [("b", shp, "f32")], prims.elementwise(shp, [shp]))
        (v,) = gb.add(Prim.RESHAPE, [b], [("v", shp, "f32")], prims.reshape(shp, shp))
        (sm,) = gb.add(Prim.SOFTMAX, [v], [("sm", shp, "f32")], prims.softmax(3, 2))
        gb.outputs.extend([sm, b] if b_is_output else [sm])
        return group_layers(annotate(gb.build()))

    size = 4 * B * S * 64
    g = fuse_pointwise(build(False))
    by = {n.outputs[0]: n for n in g.nodes}
    assert by["a"].attrs["fused_io"] == ["a"]  # writes a on chip, reads x from memory
    assert sorted(by["b"].attrs["fused_io"]) == ["a", "b"]  # both of b's operands on chip
    assert by["sm"].attrs["fused_io"] == ["v"]  # reads b through the view
    assert sympy.expand(sympy.sympify(g.meta["fusable_bytes"], locals={"B": B, "S": S}) - 4 * size) == 0
    assert sympy.expand(by["b"].bytes_moved - 2 * size) == 0  # the unfused traffic stays recorded
    kept = fuse_pointwise(build(True))
    by = {n.outputs[0]: n for n in kept.nodes}
    assert "fused_io" not in by["sm"].attrs  # b is a graph output: it is written
    assert by["b"].attrs["fused_io"] == ["a"]


def test_fused_split_factors_gpt2_qkv() -> None:
    """c_attn's [h, 3h] weight becomes [h, 3, h] in the IR, the split keeps the head label, and
    nothing the search counts (FLOPs, bytes, parameters) changes."""
    raw = _zoo_graph("gpt2-tiny")
    g = run_passes(raw, PassOptions(check=True))
    plain = run_passes(raw, PassOptions(skip=("split_fused_projections",)))
    w = "transformer.h.0.attn.c_attn.weight"
    assert g.tensors[w].shape == (64, 3, 64) and plain.tensors[w].shape == (64, 192)
    assert g.meta["strided_params"][w] == [1, 3]
    assert g.meta["strided_params"]["transformer.h.1.attn.c_attn.bias"] == [0, 3]
    assert len(g.meta["strided_params"]) == 4  # weight and bias of both blocks, nothing else
    split = next(n for n in g.nodes if n.prim is Prim.SPLIT and n.module.endswith("h.0.attn"))
    n_label = split.sig.inputs[0][-1]
    assert all(out[-1] == n_label for out in split.sig.outputs) and n_label not in split.sig.fixed
    assert sympy.expand(g.forward_flops() - plain.forward_flops()) == 0
    assert g.num_params() == plain.num_params()
    assert sum(n.bytes_moved for n in g.nodes) - sum(n.bytes_moved for n in plain.nodes) == 0
    assert len({lay.kind for lay in g.layers if lay.name.startswith("transformer.h.")}) == 1


def test_fused_split_leaves_other_splits_alone() -> None:
    """Unequal chunks, a split of an activation, and a JAX graph are not rewritten."""
    from partita.passes.fused_split import split_fused_projections

    def build(sizes: tuple[int, ...], from_param: bool, framework: str = "torch") -> Graph:
        gb = GraphBuilder("s")
        x = gb.tensor("x", (B, 64), "f32", Role.INPUT)
        w = gb.tensor("w", (192, 64), "f32", Role.PARAMETER, "w")
        (y,) = gb.add(Prim.MATMUL, [x, w], [("y", (B, 192), "f32")], prims.linear(2)) if from_param else (x,)
        src_dim = 192 if from_param else 64
        outs = [(f"o{i}", (B, s), "f32") for i, s in enumerate(sizes)]
        assert sum(sizes) == src_dim
        got = gb.add(Prim.SPLIT, [y], outs, prims.along([2], [2] * len(sizes), 1))
        gb.outputs.extend(got)
        return gb.build({"framework": framework})

    assert "strided_params" in split_fused_projections(build((64, 64, 64), True)).meta  # the positive case
    for g in (build((128, 32, 32), True), build((32, 32), False), build((64, 64, 64), True, "jax")):
        out = split_fused_projections(g)
        assert "strided_params" not in out.meta and out.tensors["w"].shape == g.tensors["w"].shape
