"""Pointwise fusion in the cost annotation: intermediates a fusing backend never writes to memory.

Runs after ``annotate`` and ``group_layers`` (``passes/pipeline.py``). The traced graph has one
node per framework op, so a tanh-GELU is seven elementwise kernels and a masked softmax with
dropout five passes over the ``B x heads x S x S`` scores. Fusing engines do not run them that
way: XLA and Inductor fuse chains of pointwise ops (and pointwise prologues into reductions such
as softmax and layer norm), and Megatron-LM ships the same fusions by hand (bias-GeLU,
scale-mask-softmax, bias-dropout-add). Eager PyTorch (what ``backends/torch/parallel.py`` runs)
does not. So this pass only marks what *can* be fused; the pricing decides how much is:
``search/layer/intra_op.py`` removes ``Efficiency.pointwise_fusion`` (0 = eager, 1 = fused) of the
marked bytes, and all of them for JAX graphs (XLA always fuses).

Rule: a tensor written by a pointwise node (``ELEMENTWISE``, ``DROPOUT``) whose only real
consumer (looking through zero-cost views) is a pointwise node or a ``SOFTMAX``/``NORM`` in the
same layer need not be materialized: its name is listed in both nodes' ``attrs["fused_io"]``
(the producer's write and the consumer's read). ``node.bytes_moved`` keeps the unfused traffic;
FLOPs and saved activations are unchanged (what backward keeps is the recompute policy's call).
``graph.meta["fusable_bytes"]`` records the marked bytes (write + read) as a string expression.
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
    """Mark fusable intermediates in ``attrs["fused_io"]`` (module docstring)."""
    consumers = graph.consumers()
    outputs = set(graph.outputs)
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
        total += graph.tensors[n.outputs[0]].nbytes() + graph.tensors[read].nbytes()
        fused.setdefault(n.name, []).append(n.outputs[0])
        fused.setdefault(c.name, []).append(read)
    if not fused:
        return graph
    nodes = [
        dataclasses.replace(n, attrs={**n.attrs, "fused_io": sorted(fused[n.name])}) if n.name in fused else n
        for n in graph.nodes
    ]
    return dataclasses.replace(
        graph.replace_nodes(nodes), meta={**graph.meta, "fusable_bytes": str(sympy.expand(total))}
    )
