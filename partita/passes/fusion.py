"""Pointwise fusion in the cost annotation: intermediates a fusing backend never writes to memory.

Runs after ``annotate`` and ``group_layers`` (``passes/pipeline.py``). The traced graph has one
node per framework op, so a tanh-GELU is seven elementwise kernels and a masked softmax with
dropout five passes over the ``B x heads x S x S`` scores. The engines Partita emits for do not
run them that way: Inductor and XLA fuse chains of pointwise ops (and pointwise prologues into
reductions such as softmax and layer norm), and Megatron-LM ships the same fusions by hand
(bias-GeLU, scale-mask-softmax, bias-dropout-add). Pricing every op as its own kernel over-counts
memory traffic several-fold for small hidden sizes.

Rule: a tensor written by a pointwise node (``ELEMENTWISE``, ``DROPOUT``) whose only real
consumer (looking through zero-cost views) is a pointwise node or a ``SOFTMAX``/``NORM`` in the
same layer is not materialized; its bytes are removed from the producer's write and the
consumer's read in ``node.bytes_moved``, and its name is listed in both nodes'
``attrs["fused_io"]`` so the intra-op pricing (``search/intra_op.py``), which recomputes bytes
per sharding strategy, skips it too. FLOPs and saved activations are unchanged (what backward
keeps is decided by the recompute policy, not by fusion). ``graph.meta["fused_bytes"]`` records
the removed bytes as a string expression so a report can show it.
"""

from __future__ import annotations

import dataclasses

import sympy

from partita.ir import Graph, Node, Prim
from partita.passes.annotate import VIEW_PRIMS

POINTWISE = frozenset({Prim.ELEMENTWISE, Prim.DROPOUT})
FUSES_PROLOGUE = POINTWISE | {Prim.SOFTMAX, Prim.NORM}


def _real_consumers(name: str, consumers: dict[str, list[Node]], outputs: set[str]) -> list[tuple[Node, str]] | None:
    """(consumer, tensor it reads) pairs reached from ``name`` through views; None if a graph output."""
    found: list[tuple[Node, str]] = []
    stack = [name]
    while stack:
        t = stack.pop()
        if t in outputs:
            return None
        for c in consumers.get(t, []):
            if c.prim in VIEW_PRIMS:
                stack.extend(c.outputs)
            else:
                found.append((c, t))
    return found


def fuse_pointwise(graph: Graph) -> Graph:
    """Remove fused intermediates' bytes from ``bytes_moved`` (module docstring)."""
    consumers = graph.consumers()
    outputs = set(graph.outputs)
    saved: dict[str, sympy.Expr] = {}
    fused: dict[str, list[str]] = {}
    total = sympy.Integer(0)
    for n in graph.nodes:
        if n.prim not in POINTWISE or len(n.outputs) != 1:
            continue
        reached = _real_consumers(n.outputs[0], consumers, outputs)
        if not reached or len(reached) != 1:
            continue
        ((c, read),) = reached
        if c.prim not in FUSES_PROLOGUE or c.layer != n.layer or sum(i == read for i in c.inputs) != 1:
            continue
        write, load = graph.tensors[n.outputs[0]].nbytes(), graph.tensors[read].nbytes()
        saved[n.name] = saved.get(n.name, sympy.Integer(0)) + write
        saved[c.name] = saved.get(c.name, sympy.Integer(0)) + load
        fused.setdefault(n.name, []).append(n.outputs[0])
        fused.setdefault(c.name, []).append(read)
        total += write + load
    if not saved:
        return graph
    nodes = [
        dataclasses.replace(
            n,
            bytes_moved=sympy.expand(n.bytes_moved - saved[n.name]),
            attrs={**n.attrs, "fused_io": sorted(fused[n.name])},
        )
        if n.name in saved
        else n
        for n in graph.nodes
    ]
    return dataclasses.replace(graph.replace_nodes(nodes), meta={**graph.meta, "fused_bytes": str(sympy.expand(total))})
