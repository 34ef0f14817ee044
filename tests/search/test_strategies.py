"""Strategy enumeration from dimension signatures (generic rule and explicit rules)."""

from __future__ import annotations

from partita import prims
from partita.cluster import DEVICE_PRESETS
from partita.ir import DimSig, Node, Prim
from partita.search.layer.strategies import enumerate_strategies
from partita.search.pricing.mesh import LogicalMesh

MESH = LogicalMesh((8,), ("tp",), DEVICE_PRESETS["A100-80G"], 8)
MESH2 = LogicalMesh((2, 4), ("dp", "tp"), DEVICE_PRESETS["A100-80G"], 8)


def node(prim: Prim, sig: DimSig, n_in: int, n_out: int = 1) -> Node:
    return Node("n", prim, tuple(f"i{k}" for k in range(n_in)), tuple(f"o{k}" for k in range(n_out)), sig)


def by_name(strats):
    return {s.name: s for s in strats}


def test_linear_column_row_and_divisibility() -> None:
    n = node(Prim.MATMUL, prims.linear(3, has_bias=True), 3)
    s = by_name(enumerate_strategies(n, {"a": 4, "b": 2048, "k": 1024, "n": 4096}, MESH))
    assert set(s) == {"R", "b@tp", "k@tp", "n@tp"}  # batch 4 not divisible by 8
    col, row = s["n@tp"], s["k@tp"]
    assert col.in_layouts == (("R",), ("S(0)",), ("S(0)",)) and col.out_layouts == (("S(2)",),)
    assert col.in_grad_layouts[0] == ("P",)  # column-parallel input grad needs an all-reduce
    assert row.out_layouts == (("P",),) and row.in_layouts[0] == ("S(2)",)
    assert row.in_grad_layouts[2] == ("R",)  # bias is added after the reduction: full grad everywhere
    assert s["b@tp"].in_grad_layouts[1] == ("P",)  # weight replicated over a batch-like split: grad sync
    assert all(x.work_divisor == (1 if x.name == "R" else 8) for x in s.values())


def test_fixed_labels_are_never_sharded_and_two_axes_may_share_a_label() -> None:
    n = node(Prim.NORM, prims.norm(3, 1, 2), 3)
    names = set(by_name(enumerate_strategies(n, {"a": 8, "b": 16, "c": 64}, MESH2)))
    assert all("c@" not in x for x in names)
    assert "a@dp,a@tp" in names and "b@dp,a@tp" in names


def test_embedding_vocab_sharding_is_partial() -> None:
    n = node(Prim.EMBEDDING, prims.embedding(2), 2)
    s = by_name(enumerate_strategies(n, {"v": 50304, "h": 1024, "a": 8, "b": 1024}, MESH))
    assert s["v@tp"].out_layouts == (("P",),)


def test_vocab_parallel_cross_entropy_explicit_rule() -> None:
    n = node(Prim.CROSS_ENTROPY, prims.cross_entropy(3), 2)
    strats = by_name(enumerate_strategies(n, {"v": 50304, "a": 8, "b": 1024}, MESH))
    assert "v@tp" not in strats  # class dim is fixed for the generic rule
    vp = strats["vocab@tp"]
    assert vp.in_layouts[0] == ("S(2)",) and vp.out_layouts == (("R",),)
    assert [c.kind for c in vp.op_collectives] == ["all_reduce"] * 3
    assert vp.op_collectives[0].bytes == 8 * 1024 * 4


def test_opaque_only_replicates() -> None:
    n = node(Prim.OPAQUE, prims.opaque([2], [2]), 1)
    assert [s.name for s in enumerate_strategies(n, {c: 8 for c in "abcd"}, MESH)] == ["R"]


def test_torch_tp_roles_of_a_linear_and_what_other_ops_may_shard() -> None:
    """``torch_tp_strategies``: a linear gets the runtime's four roles (each with its own collective and
    layouts on tp), a token label never goes on tp, a norm keeps its weight replicated on tp, and
    GPT-2's ``addmm`` bias (first operand) gets a replicated gradient under row parallelism."""
    from partita.search.layer.strategies import torch_tp_strategies

    n = Node("fc", Prim.MATMUL, ("x", "w", "b"), ("y",), prims.linear(3, has_bias=True), target="aten.linear.default")
    sizes = {"a": 8, "b": 2048, "k": 1024, "n": 4096}
    generic = enumerate_strategies(n, sizes, MESH2)
    kw = dict(is_param=[False, True, True], itemsizes=[2, 2, 2, 2], tokens={"a", "b"})
    s = by_name(torch_tp_strategies(n, generic, sizes, MESH2, **kw))
    assert not [x for x in s if "a@tp" in x or "b@tp" in x]
    col, gat, row, rep = (
        s[f"b@dp,{lab}@tp:{r}"]
        for lab, r in [("n", "colwise"), ("n", "colwise_gather"), ("k", "rowwise"), ("k", "rowwise_replicated")]
    )
    assert (col.tp_role, col.out_layouts[0], col.op_collectives) == ("colwise", ("S(1)", "S(2)"), ())
    assert col.in_grad_layouts[0] == ("S(1)", "P")  # the edge all-reduces it (intra_op.edge_cost)
    out_bytes = 8 * 2048 * 4096 * 2 / 2  # the gathered output, still split over dp
    assert gat.out_layouts[0] == ("S(1)", "R") and [(c.kind, c.phase, c.bytes) for c in gat.op_collectives] == [
        ("all_gather", "forward", out_bytes)
    ]
    assert row.in_layouts[0] == ("S(1)", "S(2)") and row.out_layouts[0] == ("S(1)", "R")
    assert [(c.kind, c.phase, c.bytes) for c in row.op_collectives] == [("all_reduce", "forward", out_bytes)]
    in_bytes = 8 * 2048 * 1024 * 2 / 2
    assert rep.in_layouts[0] == rep.in_grad_layouts[0] == ("S(1)", "R")
    assert [(c.kind, c.phase, c.bytes) for c in rep.op_collectives] == [
        ("all_reduce", "forward", out_bytes),
        ("all_gather", "backward", in_bytes),
    ]
    norm = Node("ln", Prim.NORM, ("x", "w", "b"), ("y",), prims.norm(3, 1, 2))
    nsizes = {"a": 8, "b": 16, "c": 64}
    kept = torch_tp_strategies(norm, enumerate_strategies(norm, nsizes, MESH2), nsizes, MESH2, **kw)
    assert {x.axis_labels[1] for x in kept} == {""}
    addmm = Node("p", Prim.MATMUL, ("b", "x", "w"), ("y",), DimSig(("n", "mk", "kn"), ("mn",), "k"))
    r = by_name(enumerate_strategies(addmm, {"m": 64, "k": 64, "n": 64}, MESH))["k@tp"]
    assert r.in_grad_layouts[0] == ("R",)  # the bias grad sums a replicated output grad: no tp sync
