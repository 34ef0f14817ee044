"""What a layer problem of the intra-op ILP chooses among, shared per graph.

Part of the intra-op search: ``search/layer/intra_op.py`` builds one ILP per (layer kind, device type,
``(1, tp)`` mesh, micro-batch) and asks here for each node's strategies
(``search/strategies.enumerate_strategies``, kept to Megatron's or to the torch runtime's tp roles,
:func:`node_strategies`), for the saved-activation plan of its layer (``search/layer/saved.py``) and for
the tensors whose gradient the backward computes (:func:`needs_grad`). None of these reads the
device, its links or the cost model, so the problems of one layer kind on every device type,
micro-batch and tp width share them (:func:`strategies_of`, :func:`saved_plan_of`; issue 20).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from partita.ir import Graph, Layer, Node, Role
from partita.passes.annotate import HEAVY_PRIMS
from partita.search.layer.saved import FLOAT_DTYPES, SavedPlan, saved_plan
from partita.search.layer.strategies import Strategy, enumerate_strategies, torch_tp_strategies
from partita.search.pricing.mesh import LogicalMesh

TP_STYLES = ("auto", "megatron", "megatron_sp", "torch")
_TOKENS = frozenset({"B", "S"})  # symbols of batch and sequence dims: never sharded on tp (megatron, torch)


def _megatron_only(strats: list[Strategy], tokens: set[str], mesh: LogicalMesh) -> list[Strategy]:
    """Strategies whose ``tp`` axis shards no batch or sequence dim (Megatron-LM without sequence
    parallelism: weights are split, activations stay whole on the tensor-parallel group)."""
    tp = [i for i, name in enumerate(mesh.axis_names) if name == "tp"]
    keep = [s for s in strats if not any(s.axis_labels[i] in tokens for i in tp)]
    return keep or strats[:1]


def node_strategies(
    graph: Graph,
    n: Node,
    exprs: Mapping[str, Any],
    sizes: Mapping[str, int],
    mesh: LogicalMesh,
    tp_style: str,
    torch_tp: bool,
) -> list[Strategy]:
    """The strategies ``_LayerProblem`` prices for node ``n``: ``enumerate_strategies``, kept to
    Megatron's (``tp_style="megatron"``) or to the torch runtime's tp roles (``torch_tp``). They read
    the node, its tensors' roles, item sizes and aliases, the label sizes and the mesh's shape and
    axis names: never the device, its links or the cost model."""
    strats = enumerate_strategies(n, sizes, mesh)
    tokens = {c for c, d in exprs.items() if {str(x) for x in getattr(d, "free_symbols", ())} & _TOKENS}
    if tp_style == "megatron_sp" and n.prim not in HEAVY_PRIMS:
        # Megatron sequence parallelism (Korthikanti et al. 2022, sec. 4.2.2): the ops between the column and
        # row matmuls' collectives (norms, residual adds, dropout) run on s/tp rows of the sequence; the
        # matmuls and attention keep Megatron's weight split (below), the batch stays off tp everywhere
        batch = {c for c, d in exprs.items() if "B" in {str(x) for x in getattr(d, "free_symbols", ())}}
        strats = _megatron_only(strats, batch, mesh)
        # none of them is replicated on tp: they run on s/tp rows (or, between a column and a row matmul, on
        # the column's split); a replicated norm would price an all-reduce of its input gradient where
        # Megatron reduce-scatters it (its weights' gradients are all-reduced once per step, not per op)
        tp = [i for i, name in enumerate(mesh.axis_names) if name == "tp"]
        split = [x for x in strats if any(x.axis_labels[i] for i in tp)]
        strats = split or strats
    elif tp_style in ("megatron", "megatron_sp"):
        strats = _megatron_only(strats, tokens, mesh)
    if torch_tp:
        is_param = [graph.tensors[t].role is Role.PARAMETER for t in n.inputs]
        tied = [p and bool(graph.tensors[t].aliases) for p, t in zip(is_param, n.inputs)]
        sizes_of = [graph.tensors[t].itemsize for t in (*n.inputs, *n.outputs[:1])]
        strats = torch_tp_strategies(
            n, strats, sizes, mesh, is_param=is_param, itemsizes=sizes_of, tokens=tokens, tied=tied
        )
    return strats


# per graph (its node list, as _NEEDS_GRAD): node_strategies and saved_plan results, which the layer
# problems of one layer kind on every device type, micro-batch and tp width ask again (issue 20: the
# 175B search builds 365 problems of 3 kinds; 0.4 s of strategy enumeration and saved-activation plans)
_SHARED: dict[int, tuple[list[Node], dict[tuple, tuple[Any, Any]]]] = {}


def _shared(graph: Graph) -> dict[tuple, tuple[Any, Any]]:
    hit = _SHARED.get(id(graph))
    if hit is None or hit[0] is not graph.nodes:
        if len(_SHARED) > 16:
            _SHARED.clear()
        hit = (graph.nodes, {})
        _SHARED[id(graph)] = hit
    return hit[1]


def strategies_of(
    graph: Graph,
    n: Node,
    exprs: Mapping[str, Any],
    sizes: Mapping[str, int],
    mesh: LogicalMesh,
    tp_style: str,
    torch_tp: bool,
) -> list[Strategy]:
    """:func:`node_strategies`, kept per graph under every input it reads (the node itself checked)."""
    memo = _shared(graph)
    key = ("strategies", n.name, tuple(sorted(sizes.items())), mesh.shape, mesh.axis_names, tp_style, torch_tp)
    got = memo.get(key)
    if got is None or got[0] is not n:
        got = memo[key] = (n, node_strategies(graph, n, exprs, sizes, mesh, tp_style, torch_tp))
    return list(got[1])


def saved_plan_of(
    graph: Graph, layer: Layer, mode: str, low: int, grad: frozenset[str], fp8: tuple[bool, bool] | None = None
) -> SavedPlan:
    """``saved.saved_plan``, kept per graph (the layer and the gradient set checked by identity)."""
    memo = _shared(graph)
    key = ("saved", layer.name, mode, low, id(grad), fp8)
    got = memo.get(key)
    if got is None or got[0][0] is not layer or got[0][1] is not grad:
        got = memo[key] = ((layer, grad), saved_plan(graph, layer, mode, low, grad, fp8))
    return got[1]


_NEEDS_GRAD: dict[int, tuple[list[Node], frozenset[str]]] = {}


def needs_grad(g: Graph) -> frozenset[str]:
    """Tensors of ``g`` whose gradient the backward computes: parameters and the floating-point
    results of ops that read one (a mask or rotary table built from inputs and buffers has none)."""
    hit = _NEEDS_GRAD.get(id(g))
    if hit is None or hit[0] is not g.nodes:
        out = {t for t, ten in g.tensors.items() if ten.role is Role.PARAMETER}
        for n in g.nodes:
            if any(t in out for t in n.inputs):
                out.update(o for o in n.outputs if g.tensors[o].dtype in FLOAT_DTYPES)
        if len(_NEEDS_GRAD) > 16:
            _NEEDS_GRAD.clear()
        hit = (g.nodes, frozenset(out))
        _NEEDS_GRAD[id(g)] = hit
    return hit[1]
