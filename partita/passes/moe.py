"""Mixture-of-experts layers made visible to the search: the traced experts subgraph, marked.

Runs in ``passes/pipeline.py`` before ``annotate``. transformers 5.x stores the experts of Mixtral,
Qwen2-MoE and their kin as stacked 3-D parameters (``gate_up_proj [E, 2f, h]``, ``down_proj [E, h, f]``)
and, traced, runs them as two grouped GEMMs (``frontends/torch_ops._grouped_mm``: ``x[t,k] @ w[e,k,n]``
with per-expert offsets) between a gather of the tokens sorted by expert and a weighted un-sort. The
expert label ``e`` is *fixed* in those signatures (a token row meets one expert: the generic rule
cannot shard it), so no generic strategy is expert parallelism.

This pass finds, per module, exactly two grouped GEMMs whose weights are 3-D parameters (directly or
through one permute) with the expert count as dim 0, and the router's top-k in the parent module,
and writes ``node.attrs["moe"] = {"role", "num_experts", "top_k"}`` on:

* ``weight``: the permute reading an expert parameter (the layout the traced grouped GEMM path
  takes; a model whose weights reach the GEMM unpermuted is left unmarked);
* ``dispatch``: the first grouped GEMM (tokens arrive replicated, leave sharded by expert);
* ``inner``: the nodes between the two GEMMs (gate activation, product: rows = routed pairs);
* ``combine``: the second grouped GEMM (rows go home and the output is whole again);
* ``router``: the router's matmul (``F.linear`` on a bare parameter in a module that is no
  ``nn.Linear``: the torch runtime cannot give it a tp role, so it stays replicated, as the expert
  role needs: every rank routes every token).

``search/strategies.expert_tp_strategies`` turns the marks into the ``expert`` strategy on the
``tp`` axis, which ``backends/torch/moe.py`` runs. Graphs without such modules pass through unchanged.
"""

from __future__ import annotations

import dataclasses

from partita.ir import Graph, Node, Prim, Role, dim_size


def _expert_param(graph: Graph, producer: dict[str, Node], t: str, num_experts: int) -> Node | None | str:
    """The permute node reading a 3-D expert parameter (or ``"param"`` for the parameter itself)."""
    ten = graph.tensors.get(t)
    if ten is None:
        return None
    if ten.role is Role.PARAMETER:
        return "param" if ten.rank == 3 and _size(ten.shape[0]) == num_experts else None
    n = producer.get(t)
    if n is None or n.prim is not Prim.PERMUTE or len(n.inputs) != 1:
        return None
    src = graph.tensors[n.inputs[0]]
    ok = src.role is Role.PARAMETER and src.rank == 3 and _size(src.shape[0]) == num_experts
    return n if ok else None


def _size(d: object) -> int | None:
    try:
        return int(dim_size(d))  # type: ignore[arg-type]
    except (TypeError, ValueError, KeyError):
        return None


def _router(graph: Graph, parent: str, before: int) -> tuple[int, list[Node]] | None:
    """``(k, the router's matmuls)`` of the last TOPK node under module ``parent`` before node index
    ``before``: the router module is the TOPK node's module."""
    tops = [
        n
        for n in graph.nodes[:before]
        if n.prim is Prim.TOPK and "k" in n.attrs and (n.module == parent or n.module.startswith(parent + "."))
    ]
    if not tops:
        return None
    top = tops[-1]
    mms = [n for n in graph.nodes[:before] if n.prim is Prim.MATMUL and n.module == top.module]
    return int(top.attrs["k"]), mms


def _between(graph: Graph, first: Node, last: Node, module: str) -> list[Node]:
    """Nodes of ``module`` fed (transitively) by ``first``'s output and feeding ``last``'s row input."""
    index = {n.name: i for i, n in enumerate(graph.nodes)}
    lo, hi = index[first.name], index[last.name]
    reach = set(first.outputs)
    fed = []
    for n in graph.nodes[lo + 1 : hi]:
        if (n.module == module or n.module.startswith(module + ".")) and any(t in reach for t in n.inputs):
            reach.update(n.outputs)
            fed.append(n)
    need = {last.inputs[0]}
    out = []
    for n in reversed(fed):
        if any(o in need for o in n.outputs):
            need.update(t for t in n.inputs if t in reach)
            out.append(n)
    return out[::-1] if last.inputs[0] in reach else []


def mark_experts(graph: Graph) -> Graph:
    """``graph`` with its experts subgraphs marked (module docstring); nodes are replaced, not mutated."""
    producer = {o: n for n in graph.nodes for o in n.outputs}
    grouped: dict[str, list[Node]] = {}
    for n in graph.nodes:
        if n.prim is Prim.MATMUL and "num_groups" in n.attrs:
            grouped.setdefault(n.module, []).append(n)
    marks: dict[str, dict[str, object]] = {}
    index = {n.name: i for i, n in enumerate(graph.nodes)}
    for module, mms in grouped.items():
        if len(mms) != 2 or not isinstance(mms[0].attrs["num_groups"], int):
            continue
        num_experts = int(mms[0].attrs["num_groups"])
        weights = [_expert_param(graph, producer, mm.inputs[1], num_experts) for mm in mms]
        router = _router(graph, module.rpartition(".")[0], index[mms[0].name])
        inner = _between(graph, mms[0], mms[1], module)
        if not all(isinstance(w, Node) for w in weights) or router is None or not inner:  # permuted weights only
            continue
        info = {"num_experts": num_experts, "top_k": router[0]}
        for n in router[1]:
            marks[n.name] = {"role": "router", **info}
        for w in weights:
            marks[w.name] = {"role": "weight", **info}  # type: ignore[union-attr]
        marks[mms[0].name] = {"role": "dispatch", **info}
        marks[mms[1].name] = {"role": "combine", **info}
        for n in inner:
            marks[n.name] = {"role": "inner", **info}
    if not marks:
        return graph
    nodes = [
        dataclasses.replace(n, attrs={**n.attrs, "moe": marks[n.name]}) if n.name in marks else n for n in graph.nodes
    ]
    return dataclasses.replace(graph, nodes=nodes)
