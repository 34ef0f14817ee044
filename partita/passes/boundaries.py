"""What crosses a pipeline cut: the live tensors between two layers, from the traced graph's data flow.

Read by the search (``search/pipeline/stage_cost.py`` prices a cut's p2p bytes, ``search/program/records.py`` records
them) and by the tracer (``frontends/trace_torch.py`` marks a graph the runtime cannot cut), after the
passes of ``passes/pipeline.py`` have grouped the nodes into layers. Pure functions of a ``Graph``.

The cut after layer ``i`` carries every tensor that a layer at or before ``i`` (or the step's inputs)
produced, that a layer after ``i`` reads, and that depends on a parameter: it needs a gradient back,
so the later stage cannot rebuild it. A T5 decoder cut carries the decoder hidden state, the encoder
output and block 0's relative position bias; a Llama cut only the hidden state (the causal mask and
the rotary tables depend on no parameter: every stage recomputes them). ``backends/torch/boundary.py``
applies the same rule to the running model and sends exactly these tensors (packed into one when
there are several), so the bytes priced here are the bytes sent.

A tensor crossing a cut that depends on a model input but on no parameter (a padding mask built from
an ``attention_mask`` input) cannot be rebuilt either: a later stage sees the model's inputs only as
zeros. :func:`pipeline_refusal` says so, and the search then keeps the model to one stage.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from partita.ir import Graph, Role, dim_size

LABELS = ("labels",)  # inputs the runtime hands to the last stage itself (the loss targets)
_CACHE: dict[int, tuple[Graph, list[list[str]], dict[str, int], dict[tuple, float]]] = {}


def _flow(graph: Graph) -> tuple[dict[str, bool], dict[str, int]]:
    """Per tensor: depends on a parameter; bitmask of the graph inputs it depends on."""
    bit = {t: 1 << k for k, t in enumerate(graph.inputs)}
    param = {t: ten.role is Role.PARAMETER for t, ten in graph.tensors.items()}
    ins = {t: bit.get(t, 0) for t in graph.tensors}
    for n in graph.nodes:
        p = any(param.get(i, False) for i in n.inputs)
        m = 0
        for i in n.inputs:
            m |= ins.get(i, 0)
        for o in n.outputs:
            param[o], ins[o] = p, m
    return param, ins


def _table(graph: Graph) -> tuple[list[list[str]], dict[str, int]]:
    """(per cut after layer i: live tensors crossing it, inputs bitmask of each) for ``graph``."""
    hit = _CACHE.get(id(graph))
    if hit is not None and hit[0] is graph:
        return hit[1], hit[2]
    _CACHE.pop(id(graph), None)
    param, ins = _flow(graph)
    made = {t: -1 for t in graph.inputs}
    for k, lay in enumerate(graph.layers):
        for t in lay.outputs:
            made.setdefault(t, k)
    last_read: dict[str, int] = {}
    for k, lay in enumerate(graph.layers):
        for t in lay.inputs:
            last_read[t] = k
    cuts: list[list[str]] = []
    for i in range(len(graph.layers) - 1):
        cuts.append([t for t, k in made.items() if k <= i < last_read.get(t, -1)])
    live = {t: ins.get(t, 0) if not param.get(t, False) else -1 for cut in cuts for t in cut}
    if len(_CACHE) > 16:
        _CACHE.clear()
    _CACHE[id(graph)] = (graph, cuts, live, {})
    return cuts, live


def carried(graph: Graph, index: int) -> list[str]:
    """Tensors the cut after layer ``index`` carries (module docstring), in production order."""
    cuts, live = _table(graph)
    return [t for t in cuts[index] if live[t] == -1]


def _per_sample(graph: Graph, names: Sequence[str], seq_len: int, item: int | None = None) -> float:
    env = {"B": 1, "S": seq_len}
    total = 0.0
    for t in names:
        ten = graph.tensors.get(t)
        if ten is None or ten.rank == 0:
            continue
        size = item if item is not None else ten.itemsize
        total += math.prod(dim_size(d, env) for d in ten.shape) * size
    return total


def cut_elems(graph: Graph, index: int, seq_len: int) -> int:
    """Elements per sample the cut after layer ``index`` sends (a tensor without a batch dim, e.g. a
    position bias ``(1, heads, S, S)``, once per sample: the runtime repeats it per sample)."""
    return int(_per_sample(graph, carried(graph, index), seq_len, item=1))


def cut_scale(graph: Graph, index: int, seq_len: int) -> float:
    """Bytes the cut after layer ``index`` carries over the bytes of that layer's own outputs (what a
    layer's solution prices as its boundary): 1 for a block whose output is the only live tensor, and
    for a JAX graph (its runtime sends the layer's outputs, ``backends/jax``)."""
    if index >= len(graph.layers) - 1 or graph.meta.get("framework", "torch") != "torch":
        return 1.0
    _table(graph)
    memo = _CACHE[id(graph)][3]
    if (index, seq_len) not in memo:
        own = _per_sample(graph, graph.layers[index].outputs, seq_len)
        memo[(index, seq_len)] = _per_sample(graph, carried(graph, index), seq_len) / own if own else 1.0
    return memo[(index, seq_len)]


def pipeline_refusal(graph: Graph) -> str:
    """Why no pipeline cut of ``graph`` can be run ("" when every cut can): a tensor crossing a cut
    that depends on a model input (not the labels) but on no parameter."""
    cuts, live = _table(graph)
    skip = 0
    for k, t in enumerate(graph.inputs):
        if t in LABELS:
            skip |= 1 << k
    for i, cut in enumerate(cuts):
        for t in cut:
            mask = live[t]
            if mask != -1 and mask & ~skip:
                names = [n for k, n in enumerate(graph.inputs) if mask >> k & 1 and n not in LABELS]
                return (
                    f"tensor {t} crosses the cut after layer {graph.layers[i].name}; it is computed from the model "
                    f"input(s) {', '.join(names)} without parameters, and a pipeline stage after the first sees the "
                    "model's inputs only as zeros"
                )
    return ""
