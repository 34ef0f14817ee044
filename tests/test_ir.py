"""IR contract: verifier, printer, JSON round-trip."""

import dataclasses

import pytest
import sympy

from partita import prims
from partita.errors import IRError
from partita.ir import DimSig, Graph, GraphBuilder, Prim, Role, label_sizes

B, S = sympy.symbols("B S")


def mlp_graph() -> Graph:
    b = GraphBuilder("mlp")
    b.symbols["B"] = (1, 1024)
    b.tensor("x", [B, 64], "f32", Role.INPUT)
    b.tensor("w1", [256, 64], "f32", Role.PARAMETER, fqn="fc1.weight")
    b.tensor("w2", [64, 256], "f32", Role.PARAMETER, fqn="fc2.weight")
    (h,) = b.add(Prim.MATMUL, ["x", "w1"], [("h", [B, 256], "f32")], prims.linear(2), module="fc1", name="fc1")
    (a,) = b.add(
        Prim.ELEMENTWISE,
        [h],
        [("a", [B, 256], "f32")],
        prims.elementwise([B, 256], [[B, 256]]),
        target="gelu",
        module="act",
        name="act",
    )
    (y,) = b.add(Prim.MATMUL, [a, "w2"], [("y", [B, 64], "f32")], prims.linear(2), module="fc2", name="fc2")
    b.outputs = [y]
    return b.build()


def test_verify_and_roundtrip() -> None:
    g = mlp_graph()
    g.verify()
    g2 = Graph.from_json(g.to_json())
    assert g2.as_text() == g.as_text()
    assert g2.hash() == g.hash()
    assert g.num_params() == 256 * 64 * 2
    assert label_sizes(g.node("fc1"), g) == {"a": B, "k": 64, "n": 256}


def test_printer_is_deterministic() -> None:
    assert mlp_graph().as_text() == mlp_graph().as_text()
    assert "matmul[ak,nk->an red=k](x, w1)" in mlp_graph().as_text()


def test_verifier_names_the_bad_node() -> None:
    g = mlp_graph()
    bad = dataclasses.replace(g.nodes[1], sig=DimSig(("ab",), ("abc",)))
    g.nodes[1] = bad
    with pytest.raises(IRError, match="node 'act'"):
        g.verify()


def test_verifier_rejects_use_before_def() -> None:
    g = mlp_graph()
    g.nodes = [g.nodes[1], g.nodes[0], g.nodes[2]]
    with pytest.raises(IRError, match="node 'act'.*used before it is produced"):
        g.verify()


def test_verifier_rejects_shape_mismatch() -> None:
    g = mlp_graph()
    g.tensors["w2"] = dataclasses.replace(g.tensors["w2"], shape=(sympy.Integer(64), sympy.Integer(128)))
    with pytest.raises(IRError, match="node 'fc2'.*label 'k'"):
        g.verify()


def test_reshape_signature_shares_major_dims() -> None:
    sig = prims.reshape([B, S, 768], [B, S, 12, 64])
    assert sig.inputs[0][:3] == sig.outputs[0][:3]
    assert sig.outputs[0][3] in sig.fixed
    sig = prims.reshape([B, S, 768], [B * S, 768])
    assert sig.inputs[0][0] == sig.outputs[0][0] and sig.inputs[0][1] in sig.fixed


def test_embedding_and_cross_entropy_signatures() -> None:
    assert prims.embedding(2) == DimSig(("vh", "ab"), ("abh",), "v", "")
    ce = prims.cross_entropy(2)
    assert ce.outputs == ("",) and "v" in ce.fixed
