"""Fused projections split after the matmul: expose the groups so tp can shard inside each one.

GPT-2's attention computes q, k and v with one ``[h, 3h]`` weight and splits the ``3h`` output
into three ``h`` chunks (``c_attn(x).split(h, dim=2)``); fused gate|up MLPs do the same with two.
As traced, the split dim is *fixed* (``prims.along``): a contiguous tp shard of ``3h`` holds
whole q columns on one rank and v columns on another, so the search must all-gather the output
before the split, and attention then runs on all heads on every rank. Megatron-LM avoids that
by storing the weight per head; the same effect is one layout away: shard each of the ``g``
chunks by itself (rank r holds ``[q_r | k_r | v_r]``), DTensor's ``_StridedShard(d, g)``.

This pass makes that layout an ordinary one for the search. For a SPLIT into ``g`` equal chunks
along dim ``d`` whose input comes, through single-consumer reshapes, from a MATMUL whose output
dim ``d`` is a parameter dim (the weight's, and the bias' when there is one), it factors that dim
into ``(g, n)`` on every tensor of the chain (weight, bias, matmul output, reshapes, split
input) with the new group label fixed, and lets the split's outputs keep the ``n`` label. The
ILP can then shard ``n``: the heads of each chunk, no collective before the split.

``graph.meta["strided_params"]`` maps each rewritten parameter tensor to ``[dim, g]`` (its real
dim and group count); ``search/layer/intra_op.py`` writes the placement of the IR's ``n`` dim as
``"SS(dim,g)"`` in the plan, which ``backends/torch/tp.py`` applies as ``_StridedShard(dim, g)``.
FLOPs, bytes and parameter counts are unchanged (the dims multiply to the old one).

Only PyTorch graphs: a JAX program keeps the user's global array layout, where a strided shard of
one dim is not a ``NamedSharding``; JAX models that want it write the weight per head.
Unequal chunks (grouped-query ``split_with_sizes``) are left as traced.
"""

from __future__ import annotations

import dataclasses
import string
from typing import Any

import sympy

from partita.ir import DimSig, Graph, Node, Prim, Role, Tensor

_LABELS = string.ascii_letters


def _fresh(sig: DimSig) -> str:
    used = set(sig.labels) | set(sig.fixed) | set(sig.reduced)
    return next(c for c in _LABELS if c not in used)


def _eq(a: sympy.Expr, b: sympy.Expr) -> bool:
    return sympy.simplify(sympy.sympify(a) - sympy.sympify(b)) == 0


def _split_dim(n: Node) -> int | None:
    """Position of the split dim on the input: its only fixed label no output carries."""
    lab, outs = n.sig.inputs[0], set("".join(n.sig.outputs))
    pos = [i for i, c in enumerate(lab) if c in n.sig.fixed and c not in outs]
    return pos[0] if len(pos) == 1 else None


def _chain(graph: Graph, split: Node, producer: dict[str, Node], consumers: dict[str, list[Node]]) -> list | None:
    """[(node, out position)] from the split's input back to the MATMUL, or None if no match."""
    t, p = split.inputs[0], _split_dim(split)
    if p is None:
        return None
    chain = []
    while True:
        prod = producer.get(t)
        if prod is None or len(consumers.get(t, [])) != 1 or t in graph.outputs:
            return None
        out_lab = prod.sig.outputs[prod.outputs.index(t)]
        c = out_lab[p]
        if c in prod.sig.fixed or c in prod.sig.reduced:
            return None
        if prod.prim is Prim.RESHAPE:
            in_lab = prod.sig.inputs[0]
            if c not in in_lab or len(prod.outputs) != 1:
                return None
            q = in_lab.index(c)
            if not _eq(graph.tensors[prod.inputs[0]].shape[q], graph.tensors[t].shape[p]):
                return None  # the dim is merged or split by this reshape
            chain.append((prod, p))
            t, p = prod.inputs[0], q
            continue
        if prod.prim is not Prim.MATMUL or len(prod.outputs) != 1:
            return None
        carriers = [(i, lab) for i, lab in zip(prod.inputs, prod.sig.inputs) if c in lab]
        params = [i for i, _ in carriers if graph.tensors[i].role is Role.PARAMETER]
        if not params or len(params) != len(carriers) or any(len(consumers[i]) != 1 for i in params):
            return None  # the dim comes from an activation, or the weight is shared (tied)
        chain.append((prod, p))
        return chain


def _factor(lab: str, c: str, g_label: str) -> str:
    return lab.replace(c, g_label + c) if c in lab else lab


def _factor_tensor(tensors: dict[str, Tensor], done: set[str], name: str, pos: int, g: int, chunk: Any) -> None:
    """Replace dim `pos` of tensor `name` by (g, chunk), once."""
    if name in done:
        return
    t = tensors[name]
    tensors[name] = dataclasses.replace(t, shape=(*t.shape[:pos], sympy.Integer(g), chunk, *t.shape[pos + 1 :]))
    done.add(name)


def split_fused_projections(graph: Graph) -> Graph:
    """Factor the dim of equal-chunk splits of a matmul's output (module docstring)."""
    if graph.meta.get("framework") == "jax":
        return graph
    producer = graph.producers()
    consumers = graph.consumers()
    tensors = dict(graph.tensors)
    new_nodes: dict[str, Node] = {}
    strided: dict[str, list[int]] = dict(graph.meta.get("strided_params", {}))
    for split in graph.nodes:
        if split.prim is not Prim.SPLIT or len(split.outputs) < 2 or len(split.inputs) != 1:
            continue
        g = len(split.outputs)
        p = _split_dim(split)
        shapes = [tensors[o].shape for o in split.outputs]
        if (
            p is None
            or any(len(s) != len(shapes[0]) for s in shapes)
            or len(shapes[0]) != tensors[split.inputs[0]].rank
        ):
            continue  # unbind / select drops the dim: not a chunked projection
        total = tensors[split.inputs[0]].shape[p]
        if not all(_eq(s[p], shapes[0][p]) for s in shapes) or not _eq(shapes[0][p] * g, total):
            continue
        chain = _chain(graph, split, producer, consumers)
        if chain is None:
            continue
        chunk = shapes[0][p]
        rewritten: set[str] = set()
        for node, pos in chain:
            out_lab = node.sig.outputs[0]
            c = out_lab[pos]
            gl = _fresh(node.sig)
            for name, lab in (*zip(node.inputs, node.sig.inputs), *zip(node.outputs, node.sig.outputs)):
                if c in lab:
                    _factor_tensor(tensors, rewritten, name, lab.index(c), g, chunk)
                    if graph.tensors[name].role is Role.PARAMETER:
                        strided[name] = [lab.index(c), g]
            sig = DimSig(
                tuple(_factor(s, c, gl) for s in node.sig.inputs),
                tuple(_factor(s, c, gl) for s in node.sig.outputs),
                node.sig.reduced,
                node.sig.fixed + gl,
            )
            new_nodes[node.name] = dataclasses.replace(node, sig=sig)
        # the split: input (.., g, n), outputs (.., n) sharing n; the group label is fixed
        in_lab = split.sig.inputs[0]
        old = in_lab[p]
        gl = _fresh(split.sig)
        outs = tuple(s[:p] + old + s[p + 1 :] for s in split.sig.outputs)
        dropped = {s[p] for s in split.sig.outputs}
        fixed = "".join(c for c in split.sig.fixed if c != old and c not in dropped) + gl
        new_nodes[split.name] = dataclasses.replace(
            split, sig=DimSig((in_lab[:p] + gl + old + in_lab[p + 1 :],), outs, "", fixed)
        )
    if not new_nodes:
        return graph
    meta = dict(graph.meta) | {"strided_params": strided}
    nodes = [new_nodes.get(n.name, n) for n in graph.nodes]
    return dataclasses.replace(graph, tensors=tensors, nodes=nodes, meta=meta)
