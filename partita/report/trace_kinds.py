"""Readable names for layer kinds: ``Layer.kind`` is a structural hash (``passes/layers.py``), which
tells a reader nothing; ``partita trace`` shows what a kind contains instead ("attention, 4 matmul,
2 norm").

Part of ``report/``; reads a traced Graph (the IR, below it), never the search or the runtimes.
"""

from __future__ import annotations

from collections import Counter

from partita.ir import Graph, Prim

# What a reader recognizes a layer by, in the order a label names them; the rest is bookkeeping.
_NOTABLE: tuple[tuple[Prim, str], ...] = (
    (Prim.EMBEDDING, "embedding"),
    (Prim.ATTENTION, "attention"),
    (Prim.TOPK, "router"),
    (Prim.MATMUL, "matmul"),
    (Prim.CONV, "conv"),
    (Prim.NORM, "norm"),
    (Prim.BATCH_NORM, "batch norm"),
    (Prim.POOL, "pool"),
    (Prim.SOFTMAX, "softmax"),
    (Prim.CROSS_ENTROPY, "loss"),
    (Prim.OPAQUE, "opaque op"),
)
_PLURAL = {"loss": "losses", "batch norm": "batch norms", "opaque op": "opaque ops"}
_UNIQUE = {Prim.EMBEDDING, Prim.ATTENTION, Prim.CROSS_ENTROPY}  # named without a count when single


def _label(prims: Counter[Prim]) -> str:
    parts = []
    for prim, word in _NOTABLE:
        n = prims.get(prim, 0)
        if n:
            parts.append(
                word if n == 1 and prim in _UNIQUE else f"{n} {word if n == 1 else _PLURAL.get(word, word + 's')}"
            )
    if not parts:  # only pointwise / shape ops: name the most frequent
        prim, _ = max(prims.items(), key=lambda kv: (kv[1], kv[0].value)) if prims else (Prim.ELEMENTWISE, 0)
        parts.append(prim.value)
    return ", ".join(parts)


def kind_labels(graph: Graph) -> dict[str, str]:
    """Layer kind hash -> a readable description of its contents; two kinds that read the same are
    told apart by ``(variant 2)``, ``(variant 3)``..."""
    by_name = {n.name: n for n in graph.nodes}
    out: dict[str, str] = {}
    seen: Counter[str] = Counter()
    for lay in graph.layers:
        if lay.kind in out:
            continue
        label = _label(Counter(by_name[x].prim for x in lay.nodes if x in by_name))
        seen[label] += 1
        out[lay.kind] = label if seen[label] == 1 else f"{label} (variant {seen[label]})"
    return out
