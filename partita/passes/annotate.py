"""Cost annotation: forward FLOPs and bytes moved per node, and per-layer statistics.

A pass in ``passes/pipeline.py`` (after tracing, before the search). FLOPs come from one rule per
:class:`Prim` (``FLOP_RULES``); all are sympy expressions, symbolic in ``B``/``S`` where shapes are.

* MATMUL: ``2 * prod(label sizes)`` (grouped MoE GEMMs divide by the number of groups: each token
  meets one expert).
* ATTENTION: ``4 * b * h * s * t * d`` -- QK^T and PV, the *full* score matrix: causal masking is
  not halved, matching what SDPA kernels without block skipping execute.
* CONV: ``2 * out_numel * c_in / groups * prod(kernel)``.
* pointwise / norm / softmax / loss: a small count per element (``_PER_ELEMENT``).
* view-like ops (reshape, permute, expand, slice, split): 0 FLOPs and 0 bytes.

``bytes_moved`` = bytes of the tensor operands read + results written (lookups read only the rows
they gather). :func:`layer_stats` rolls these up per layer for a concrete ``env`` (``{"B": 8, "S": 2048}``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

import sympy

from partita.ir import Graph, Node, Prim, Role, Tensor, dim_size

VIEW_PRIMS = frozenset({Prim.RESHAPE, Prim.PERMUTE, Prim.EXPAND, Prim.SLICE, Prim.SPLIT})
HEAVY_PRIMS = frozenset({Prim.MATMUL, Prim.ATTENTION, Prim.CONV})  # backward = 2x forward
_PER_ELEMENT: dict[Prim, int] = {
    Prim.ELEMENTWISE: 1,
    Prim.DROPOUT: 2,  # mask draw + scale
    Prim.NORM: 5,  # mean, variance, normalize, scale, shift
    Prim.BATCH_NORM: 5,
    Prim.SOFTMAX: 5,  # max, subtract, exp, sum, divide
    Prim.CROSS_ENTROPY: 5,  # log-softmax over the logits + pick
    Prim.REDUCE: 1,
    Prim.POOL: 1,
    Prim.TOPK: 1,
}
FlopRule = Callable[[Node, Graph], sympy.Expr]
# Fused pointwise ops counted by the primitive ops they stand for, so a fused torch op and the
# same function decomposed by JAX count alike (tanh-gelu = x^3, mul, add, mul, tanh, add, mul, mul).
_TARGET_PER_ELEMENT: dict[str, int] = {
    "gelu": 5,
    "gelu_tanh": 8,
    "silu": 4,
    "sigmoid": 4,
    "mish": 6,
    "softplus": 3,
    "mse_loss": 3,
    "l1_loss": 3,
    "smooth_l1_loss": 4,
}


def _t(g: Graph, name: str) -> Tensor:
    return g.tensors[name]


def _label_sizes(node: Node, g: Graph) -> dict[str, sympy.Expr]:
    """Each label's size, preferring a non-1 size where an operand broadcasts."""
    sizes: dict[str, sympy.Expr] = {}
    for names, labels in ((node.outputs, node.sig.outputs), (node.inputs, node.sig.inputs)):
        for tname, lab in zip(names, labels):
            for c, d in zip(lab, _t(g, tname).shape):
                if c not in sizes or sizes[c] == 1:
                    sizes[c] = d
    return sizes


def _matmul(node: Node, g: Graph) -> sympy.Expr:
    flops = 2 * sympy.Mul(*_label_sizes(node, g).values())
    groups = node.attrs.get("num_groups")
    if groups:
        flops = flops / sympy.sympify(groups)
    if len(node.inputs) == 3 and "linear" in node.target:  # fused bias: one add per output element
        flops = flops + _t(g, node.outputs[0]).numel()
    return flops


def _target_key(node: Node) -> str:
    base = node.target.split(".")[1] if node.target.startswith("aten.") else node.target
    if base == "gelu" and node.attrs.get("approximate") == "tanh":
        return "gelu_tanh"
    return base


def _attention(node: Node, g: Graph) -> sympy.Expr:
    q, k = _t(g, node.inputs[0]), _t(g, node.inputs[1])
    return 4 * q.numel() * k.shape[-2]


def _conv(node: Node, g: Graph) -> sympy.Expr:
    w = _t(g, node.inputs[1])
    return 2 * _t(g, node.outputs[0]).numel() * (w.numel() / w.shape[0])


def _per_element(node: Node, g: Graph) -> sympy.Expr:
    k = _TARGET_PER_ELEMENT.get(_target_key(node), _PER_ELEMENT[node.prim])
    if node.prim in (Prim.REDUCE, Prim.POOL, Prim.TOPK, Prim.CROSS_ENTROPY):
        return k * _t(g, node.inputs[0]).numel() if node.inputs else sympy.Integer(0)
    return k * sum((_t(g, o).numel() for o in node.outputs), sympy.Integer(0))


def _zero(node: Node, g: Graph) -> sympy.Expr:
    return sympy.Integer(0)


FLOP_RULES: dict[Prim, FlopRule] = {p: _per_element for p in _PER_ELEMENT}
FLOP_RULES.update({Prim.MATMUL: _matmul, Prim.ATTENTION: _attention, Prim.CONV: _conv})
FLOP_RULES.update({p: _zero for p in (*VIEW_PRIMS, Prim.CAT, Prim.CONSTANT, Prim.OPAQUE, Prim.EMBEDDING)})
FLOP_RULES.update({p: _zero for p in (Prim.GATHER, Prim.SCATTER, Prim.INDEX)})


def bytes_moved(node: Node, g: Graph) -> sympy.Expr:
    if node.prim in VIEW_PRIMS:
        return sympy.Integer(0)
    out = sum((_t(g, o).nbytes() for o in node.outputs), sympy.Integer(0))
    if node.prim in (Prim.EMBEDDING, Prim.GATHER, Prim.INDEX):  # reads the gathered rows, not the table
        idx = sum((_t(g, i).nbytes() for i in node.inputs[1:]), sympy.Integer(0))
        return 2 * out + idx
    return out + sum((_t(g, i).nbytes() for i in node.inputs), sympy.Integer(0))


def annotate(graph: Graph) -> Graph:
    """Set ``node.flops`` and ``node.bytes_moved`` on every node."""
    nodes = [
        dataclasses.replace(
            n, flops=sympy.expand(FLOP_RULES.get(n.prim, _zero)(n, graph)), bytes_moved=bytes_moved(n, graph)
        )
        for n in graph.nodes
    ]
    return graph.replace_nodes(nodes)


@dataclasses.dataclass(frozen=True)
class LayerStats:
    name: str
    kind: str
    forward_flops: int
    backward_flops: int  # 2x forward for MATMUL/ATTENTION/CONV (grads w.r.t. inputs and weights), 1x others
    param_count: int
    param_bytes: int
    activation_bytes: int  # forward activations saved for backward (views resolved to their base)
    boundary_bytes: int  # bytes of the layer's output activations
    num_nodes: int


def _view_base(name: str, producers: Mapping[str, Node]) -> str:
    while name in producers and producers[name].prim in VIEW_PRIMS and producers[name].inputs:
        name = producers[name].inputs[0]
    return name


def layer_stats(graph: Graph, env: Mapping[str, int]) -> list[LayerStats]:
    """Per-layer totals for concrete symbol values (run :func:`annotate` and ``group_layers`` first)."""
    by_name = {n.name: n for n in graph.nodes}
    producers = graph.producers()
    out: list[LayerStats] = []
    for layer in graph.layers:
        nodes = [by_name[x] for x in layer.nodes]
        fwd = bwd = 0
        saved: set[str] = set()
        for n in nodes:
            f = dim_size(n.flops, env)
            fwd += f
            bwd += 2 * f if n.prim in HEAVY_PRIMS else f
            if n.prim in VIEW_PRIMS or n.prim is Prim.CONSTANT:
                continue
            for i in n.inputs:
                base = _view_base(i, producers)
                if graph.tensors[base].role in (Role.ACTIVATION, Role.INPUT):
                    saved.add(base)
        params = [graph.tensors[p] for p in layer.params]
        out.append(
            LayerStats(
                name=layer.name,
                kind=layer.kind,
                forward_flops=fwd,
                backward_flops=bwd,
                param_count=sum(dim_size(t.numel(), env) for t in params),
                param_bytes=sum(dim_size(t.nbytes(), env) for t in params),
                activation_bytes=sum(dim_size(graph.tensors[s].nbytes(), env) for s in sorted(saved)),
                boundary_bytes=sum(dim_size(graph.tensors[o].nbytes(), env) for o in layer.outputs),
                num_nodes=len(nodes),
            )
        )
    return out
